"""What an engine reported as served from cache: ``usage.prompt_tokens_details.cached_tokens``
of a JSON response, or of the SSE chunk that carries usage in a stream (read after each chunk
was relayed, so the stream is never held back). The router compares it with the hit tokens it
predicted (``router_reported_cached_tokens_total``)."""
from __future__ import annotations

import json

_USAGE_MARK = b'"cached_tokens"'


def cached_tokens(obj) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a response or chunk object, or None."""
    try:
        return int(obj["usage"]["prompt_tokens_details"]["cached_tokens"])
    except (KeyError, TypeError, ValueError):
        return None


class UsageScanner:
    """Finds ``cached_tokens`` in an SSE stream fed chunk by chunk (after the chunk was sent
    on): only complete ``data:`` lines that mention ``"cached_tokens"`` are decoded."""

    def __init__(self) -> None:
        self._tail = b""
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk
        lines = data.split(b"\n")
        self._tail = lines.pop()
        if _USAGE_MARK not in data:
            return
        for line in lines:
            if line.startswith(b"data:") and _USAGE_MARK in line:
                try:
                    n = cached_tokens(json.loads(line[5:]))
                except ValueError:
                    continue
                if n is not None:
                    self.cached_tokens = n
