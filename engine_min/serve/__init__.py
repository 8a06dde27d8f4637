"""engine_min's OpenAI-compatible HTTP server (`python -m engine_min serve`) around the engine core."""
