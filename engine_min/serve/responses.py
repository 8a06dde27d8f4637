"""OpenAI-compatible response builders for ``engine_min.serve.server``.

Responses follow the OpenAI wire format: ``text_completion`` / ``chat.completion`` objects, and
for ``stream: true`` Server-Sent Events of chunk objects (``data: {...}\\n\\n``) ending in
``data: [DONE]\\n\\n``. Every non-streamed response carries ``usage`` with ``prompt_tokens``,
``completion_tokens``, ``total_tokens`` and ``prompt_tokens_details.cached_tokens``.
``TextStreamer`` cuts a growing decoded text into deltas safe to stream.

With ``return_token_ids`` (vLLM's extension, ``add_token_ids``) a response also carries token
ids: the choice's ``token_ids`` (the output's; in a stream, each chunk's are the tokens
generated since the previous chunk, so a stream's chunks add up to the output) and
``prompt_token_ids`` (the prompt after tokenization and, for chat, the template: at the top
level of a chat response or of a chat stream's first chunk, in the choice of a completion
response or of a completion stream's first chunk). Pure functions; the
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
                        finish_reason: str | None, usage_obj: dict,
                        stop_reason: str | int | None = None) -> dict:
    """A non-streamed ``text_completion`` object with one choice (``stop_reason``: vLLM's,
    the matched stop string or stop token id, else null)."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason, "stop_reason": stop_reason}],
            "usage": usage_obj}


def chat_response(request_id: str, model: str, created: int, text: str,
                  finish_reason: str | None, usage_obj: dict,
                  stop_reason: str | int | None = None) -> dict:
    """A non-streamed ``chat.completion`` object with one assistant message."""
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason,
                         "stop_reason": stop_reason}],
            "usage": usage_obj}


def completion_chunk(request_id: str, model: str, created: int, text: str,
                     finish_reason: str | None, include_usage: bool,
                     stop_reason: str | int | None = None, usage_obj: dict | None = None
                     ) -> dict:
    """One streamed ``text_completion`` chunk (``usage``: ``usage_obj``, null unless
    ``stream_options.continuous_usage_stats``, when usage is requested)."""
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": 0, "text": text, "logprobs": None,
                          "finish_reason": finish_reason, "stop_reason": stop_reason}]}
    if include_usage:
        chunk["usage"] = usage_obj
    return chunk


def chat_chunk(request_id: str, model: str, created: int, delta: dict,
               finish_reason: str | None, include_usage: bool,
               stop_reason: str | int | None = None, usage_obj: dict | None = None) -> dict:
    """One streamed ``chat.completion.chunk``; ``delta`` is ``{"role": ...}``, ``{"content":
    ...}`` or ``{}`` on the last chunk; ``usage`` as in ``completion_chunk``."""
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created,
             "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish_reason,
                                          "stop_reason": stop_reason}]}
    if include_usage:
        chunk["usage"] = usage_obj
    return chunk


def usage_chunk(request_id: str, model: str, created: int, kind: str, usage_obj: dict) -> dict:
    """The final streamed chunk of ``stream_options.include_usage``: no choices, the usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": [], "usage": usage_obj}


def add_token_ids(obj: dict, kind: str, token_ids: list[int],
                  prompt_token_ids: list[int] | None) -> dict:
    """``obj`` (a response or chunk of ``kind`` ``"chat"`` | ``"completion"``, one choice)
    with ``token_ids`` in its choice and, unless None, ``prompt_token_ids`` where the
    module docstring says; returns ``obj``."""
    choice = obj["choices"][0]
    choice["token_ids"] = list(token_ids)
    if prompt_token_ids is not None:
        (obj if kind == "chat" else choice)["prompt_token_ids"] = list(prompt_token_ids)
    return obj


class StreamTokenIds:
    """What a stream with ``return_token_ids`` has sent of its token ids: ``update`` with the
    output's ids so far, ``attach`` to each chunk sent (the prompt's ids to the first, the ids
    not sent yet to each: the chunks' ``token_ids`` add up to the output)."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt: list[int] | None = list(prompt_token_ids)
        self.output: list[int] = []
        self.sent = 0

    def update(self, output_token_ids: list[int]) -> None:
        self.output = output_token_ids

    def attach(self, chunk: dict, kind: str, tokens: bool = True) -> dict:
        """Add the ids to ``chunk`` (``tokens`` False: none of the output's, an empty list)."""
        new = self.output[self.sent:] if tokens else []
        self.sent += len(new)
        add_token_ids(chunk, kind, new, self.prompt)
        self.prompt = None
        return chunk


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
