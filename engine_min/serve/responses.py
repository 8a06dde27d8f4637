"""OpenAI-compatible response builders for ``engine_min.serve.server``.

Responses follow the OpenAI wire format: ``text_completion`` / ``chat.completion`` objects, and
for ``stream: true`` Server-Sent Events of chunk objects (``data: {...}\\n\\n``) ending in
``data: [DONE]\\n\\n``. Every non-streamed response carries ``usage`` with ``prompt_tokens``,
``completion_tokens``, ``total_tokens`` and ``prompt_tokens_details.cached_tokens``.
``TextStreamer`` cuts a growing decoded text into deltas safe to stream. Pure functions; the
requests they answer are parsed by ``engine_min.serve.protocol``.
"""
from __future__ import annotations

import json


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict:
    """The OpenAI ``usage`` object (token counts)."""
    return {"prompt_tokens": num_prompt_tokens,
            "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def completion_response(request_id: str, model: str, created: int, text: str,
                        finish_reason: str | None, usage_obj: dict) -> dict:
    """A non-streamed ``text_completion`` object with one choice."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage_obj}


def chat_response(request_id: str, model: str, created: int, text: str,
                  finish_reason: str | None, usage_obj: dict) -> dict:
    """A non-streamed ``chat.completion`` object with one assistant message."""
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_obj}


def completion_chunk(request_id: str, model: str, created: int, text: str,
                     finish_reason: str | None, include_usage: bool) -> dict:
    """One streamed ``text_completion`` chunk (``usage: null`` when usage is requested)."""
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": 0, "text": text, "logprobs": None,
                          "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(request_id: str, model: str, created: int, delta: dict,
               finish_reason: str | None, include_usage: bool) -> dict:
    """One streamed ``chat.completion.chunk``; ``delta`` is ``{"role": ...}``, ``{"content":
    ...}`` or ``{}`` on the last chunk."""
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created,
             "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(request_id: str, model: str, created: int, kind: str, usage_obj: dict) -> dict:
    """The final streamed chunk of ``stream_options.include_usage``: no choices, the usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": [], "usage": usage_obj}


def sse(obj: dict | str) -> bytes:
    """One Server-Sent Event: ``data: <json>\\n\\n`` (or ``data: [DONE]\\n\\n`` for a str)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


class TextStreamer:
    """Turns a growing decoded text into safe deltas for streaming.

    The engine reports the full text generated so far. A delta is held back while the text
    ends in an incomplete UTF-8 sequence (U+FFFD from a partial byte token) or in a prefix of
    a stop string (the stop string might still complete and be cut off). On the final output
    everything left is flushed, so the concatenated deltas equal the final text.
    """

    def __init__(self, stop: tuple[str, ...] = ()):
        self.stop = stop
        self.sent = ""

    def _holdback(self, text: str) -> int:
        """How many trailing characters of ``text`` must not be sent yet."""
        hold = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def delta(self, text: str, finished: bool) -> str:
        """The new text to send for cumulative ``text`` (may be ``""``)."""
        if not text.startswith(self.sent):
            return ""  # never retract what was sent; the engine only appends
        end = len(text) if finished else len(text) - self._holdback(text)
        if end <= len(self.sent):
            return ""
        out = text[len(self.sent):end]
        self.sent = text[:end]
        return out
