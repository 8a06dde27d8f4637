"""OpenAI-compatible request validation for ``engine_min.serve.server``: parsing a request body
into an ``ApiRequest`` or an ``ApiError``.

Pure functions and small value types; nothing here touches the engine, the event loop or the
network, so every rule is testable on plain dicts.

Requests: ``parse_completion_request`` (``POST /v1/completions``) and ``parse_chat_request``
(``POST /v1/chat/completions``) turn a decoded JSON body into an ``ApiRequest`` or raise
``ApiError`` (HTTP 400 with an OpenAI-style error object). ``check_context`` then checks the
tokenized prompt against the model's context length and resolves the default ``max_tokens``.

Supported fields: ``model``, ``prompt`` (a string, a list of token ids, or a one-element list of
either), ``messages``, ``max_tokens`` / ``max_completion_tokens``, ``temperature`` (0 to 2;
below 1e-5, ``engine_min.sampler.SAMPLING_EPS``, it is greedy exactly as 0, vLLM's rule), ``top_p``,
``top_k`` (extension; 0 or -1 disables), ``seed``, ``stop`` (string or list of strings),
``stop_token_ids`` and ``ignore_eos`` (extensions), ``n`` (1 only), ``stream``,
``stream_options.include_usage``, ``presence_penalty`` / ``frequency_penalty``, and vLLM's
extensions of ``engine_min.serve.vllm_fields`` (``min_tokens``, ``repetition_penalty``,
``min_p``, ``include_stop_str_in_output``, ``truncate_prompt_tokens``,
``continuous_usage_stats``, chat ``add_generation_prompt`` / ``continue_final_message``).
Unknown fields are ignored, as OpenAI-compatible servers do; known fields of the wrong type,
and features we do not implement (logprobs, echo, n > 1, the vLLM fields of
``vllm_fields.REFUSED``), are rejected with 400.

Responses are built by ``engine_min.serve.responses``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_STRINGS = 16
#: the seeds a torch.Generator accepts (int64 down, uint64 up)
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1


class ApiError(Exception):
    """A request the server refuses; rendered by ``error_body`` with HTTP ``status``.

    Attributes:
        message: human-readable reason.
        param: the offending request field, or ``None``.
        code: a short machine-readable code, or ``None``.
        status: the HTTP status (400 unless stated).
        type: the OpenAI error type (``invalid_request_error`` for 4xx).
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.type = type


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error object ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class ApiRequest:
    """A validated completion or chat request.

    Attributes:
        kind: ``"completion"`` or ``"chat"``.
        model: the requested model name, or ``None`` if the body gave none.
        prompt: completion prompt (text or token ids); ``None`` for chat.
        messages: chat messages as ``{"role", "content"}`` dicts with string content; ``None``
            for completions.
        max_tokens: requested completion length in tokens, or ``None`` for the default
            (16 for completions, the rest of the context for chat).
        sampling: keyword arguments for ``engine_min.sampler.SamplingParams`` except
            ``max_tokens`` (temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos).
        stream: send Server-Sent Events.
        include_usage: with ``stream``, send a final chunk carrying ``usage``.
        return_token_ids: answer with the prompt's and the output's token ids too (vLLM's
            extension, ``engine_min.serve.responses.add_token_ids``).
        truncate_prompt_tokens: keep the prompt's last k tokens (-1: ``max_model_len``), or
            None; continuous_usage: with ``include_usage``, usage on every chunk;
            add_generation_prompt / continue_final_message: how a chat is rendered
            (``engine_min.serve.vllm_fields``).
    """

    kind: str
    model: str | None
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    sampling: dict = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    truncate_prompt_tokens: int | None = None
    continuous_usage: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False


def loads_body(raw: bytes) -> dict:
    """Decode a request body. Raises ``ApiError`` unless it is a JSON object."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"Request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise ApiError("Request body must be a JSON object.", code="invalid_json")
    return body


# ---------------------------------------------------------------- field checks

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(float(v)))


def _bad_type(name: str, expected: str) -> ApiError:
    return ApiError(f"'{name}' must be {expected}.", param=name, code="invalid_type")


def _opt(body: dict, name: str, check, expected: str):
    """``body[name]`` if present and not null, else ``None``; ``ApiError`` if the type is wrong."""
    v = body.get(name)
    if v is None:
        return None
    if not check(v):
        raise _bad_type(name, expected)
    return v


def _check_text(text: str, param: str) -> str:
    """``text`` if it is encodable Unicode; JSON ``"\\ud800"`` decodes to a lone surrogate, which
    no tokenizer accepts (it used to end in a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(f"'{param}' is not valid Unicode: lone surrogate "
                       f"{text[exc.start]!r} at character {exc.start}.", param=param,
                       code="invalid_value") from None
    return text


def _token_ids(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


def _parse_prompt(body: dict) -> str | list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise ApiError("'prompt' is required.", param="prompt", code="missing_field")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or _token_ids(p[0])):
        p = p[0]  # a batch of one
    if isinstance(p, str) or _token_ids(p):
        if len(p) == 0:
            raise ApiError("'prompt' must not be empty.", param="prompt", code="empty_prompt")
        return _check_text(p, "prompt") if isinstance(p, str) else p
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        raise ApiError("Batched prompts are not supported; send one prompt per request.",
                       param="prompt", code="unsupported")
    raise _bad_type("prompt", "a string or a list of token ids")


def _content_text(content: Any, i: int, role: str) -> str:
    """Message content as text: a string, or a list of ``{"type": "text", "text"}`` parts;
    null only for an assistant message (read as ""). Raises ``ApiError`` (400)."""
    if content is None:
        if role == "assistant":
            return ""
        raise _bad_type(f"messages[{i}].content", "a string or a list of text parts (null "
                        "only for an assistant message)")
    if isinstance(content, str):
        return _check_text(content, f"messages[{i}].content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ApiError("Only text content parts ({'type': 'text', 'text': ...}) "
                               "are supported.", param=f"messages[{i}].content",
                               code="unsupported")
            parts.append(part["text"])
        return _check_text("".join(parts), f"messages[{i}].content")
    raise _bad_type(f"messages[{i}].content", "a string or a list of text parts")


def parse_messages(body: dict) -> list[dict]:
    """``body["messages"]`` as ``[{"role", "content": str}]`` (``developer`` read as
    ``system``, text parts joined). Raises ``ApiError`` (400)."""
    msgs = body.get("messages")
    if msgs is None:
        raise ApiError("'messages' is required.", param="messages", code="missing_field")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("'messages' must be a non-empty list.", param="messages",
                       code="invalid_type")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad_type(f"messages[{i}]", "an object")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(f"messages[{i}].role must be one of system, developer, user, "
                           f"assistant, tool; got {role!r}.", param=f"messages[{i}].role",
                           code="invalid_value")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content_text(m.get("content"), i, role)})
    return out


def _parse_stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise _bad_type("stop", "a non-empty string or a list of non-empty strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(f"At most {MAX_STOP_STRINGS} stop strings are supported.",
                       param="stop", code="invalid_value")
    return tuple(stop)


def _check_unsupported(body: dict, kind: str) -> None:
    """Reject features this server does not implement instead of silently ignoring them."""
    n = _opt(body, "n", _is_int, "an integer")
    if n is not None and n != 1:
        raise ApiError("Only n=1 is supported.", param="n", code="unsupported")
    best_of = _opt(body, "best_of", _is_int, "an integer")
    if best_of is not None and best_of != 1:
        raise ApiError("Only best_of=1 is supported.", param="best_of", code="unsupported")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise ApiError("logprobs are not supported.", param="logprobs", code="unsupported")
    if body.get("logit_bias") not in (None, {}):
        raise ApiError("'logit_bias' is not supported.", param="logit_bias", code="unsupported")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ApiError("'response_format' is not supported (only {'type': 'text'}).",
                       param="response_format", code="unsupported")
    for name in ("tools", "functions"):
        if body.get(name) not in (None, []):
            raise ApiError(f"'{name}' (tool calling) is not supported.", param=name,
                           code="unsupported")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise ApiError(f"'{name}' is not supported (tool calling).", param=name,
                           code="unsupported")
    if kind == "completion" and body.get("echo") not in (None, False):
        raise ApiError("'echo' is not supported.", param="echo", code="unsupported")
    if kind == "completion" and body.get("suffix") not in (None, ""):
        raise ApiError("'suffix' is not supported.", param="suffix", code="unsupported")


def _parse_sampling(body: dict) -> dict:
    """SamplingParams keyword arguments (without ``max_tokens``) from a request body.

    ``temperature`` must be a finite number in [0, 2]; any value below 1e-5 (1e-40 included)
    is accepted and samples greedily (``engine_min.sampler.SamplingParams.greedy``)."""
    temperature = _opt(body, "temperature", _is_number, "a number")
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise ApiError("'temperature' must be in [0, 2].", param="temperature",
                       code="invalid_value")
    top_p = _opt(body, "top_p", _is_number, "a number")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ApiError("'top_p' must be in (0, 1].", param="top_p", code="invalid_value")
    top_k = _opt(body, "top_k", _is_int, "an integer")
    if top_k is not None and top_k < -1:
        raise ApiError("'top_k' must be -1, 0 (disabled) or positive.", param="top_k",
                       code="invalid_value")
    seed = _opt(body, "seed", _is_int, "an integer")
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise ApiError(f"'seed' must be in [{SEED_MIN}, {SEED_MAX}].", param="seed",
                       code="invalid_value")
    stop_token_ids = _opt(body, "stop_token_ids", _token_ids, "a list of token ids")
    ignore_eos = _opt(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean")
    kw: dict = {"stop": _parse_stop(body)}
    if temperature is not None:
        kw["temperature"] = float(temperature)
    if top_p is not None:
        kw["top_p"] = float(top_p)
    if top_k is not None:
        kw["top_k"] = max(top_k, 0)
    if seed is not None:
        kw["seed"] = seed
    if stop_token_ids:
        kw["stop_token_ids"] = tuple(stop_token_ids)
    if ignore_eos is not None:
        kw["ignore_eos"] = ignore_eos
    return kw


def _parse_common(body: dict, kind: str) -> dict:
    from engine_min.serve import vllm_fields
    _check_unsupported(body, kind)
    vllm_fields.refuse_unimplemented(body, kind)
    model = _opt(body, "model", lambda v: isinstance(v, str), "a string")
    max_tokens = _opt(body, "max_tokens", _is_int, "an integer")
    if kind == "chat":
        mct = _opt(body, "max_completion_tokens", _is_int, "an integer")
        max_tokens = mct if mct is not None else max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"'max_tokens' must be at least 1, got {max_tokens}.",
                       param="max_tokens", code="invalid_value")
    stream = _opt(body, "stream", lambda v: isinstance(v, bool), "a boolean") or False
    opts = _opt(body, "stream_options", lambda v: isinstance(v, dict), "an object") or {}
    if opts and not stream:
        raise ApiError("'stream_options' is only allowed with stream=true.",
                       param="stream_options", code="invalid_value")
    include_usage = _opt(opts, "include_usage", lambda v: isinstance(v, bool), "a boolean")
    ids = _opt(body, "return_token_ids", lambda v: isinstance(v, bool), "a boolean")
    sampling = {**_parse_sampling(body), **vllm_fields.parse_vllm_sampling(body, max_tokens)}
    return {"kind": kind, "model": model, "max_tokens": max_tokens, "sampling": sampling,
            "stream": stream, "include_usage": bool(include_usage),
            "return_token_ids": bool(ids),
            **vllm_fields.parse_request_options(body, kind, opts)}


def parse_completion_request(body: dict) -> ApiRequest:
    """Validate a ``POST /v1/completions`` body. Raises ``ApiError`` (400)."""
    common = _parse_common(body, "completion")
    return ApiRequest(prompt=_parse_prompt(body), **common)


def parse_chat_request(body: dict) -> ApiRequest:
    """Validate a ``POST /v1/chat/completions`` body. Raises ``ApiError`` (400)."""
    common = _parse_common(body, "chat")
    return ApiRequest(messages=parse_messages(body), **common)


DEFAULT_COMPLETION_MAX_TOKENS = 16


def check_context(req: ApiRequest, prompt_token_ids: list[int], max_model_len: int,
                  vocab_size: int) -> int:
    """Check the tokenized prompt against the context; return the ``max_tokens`` to use.

    Args:
        req: the validated request.
        prompt_token_ids: the prompt after tokenization (chat: after the chat template).
        max_model_len: the model's context length in tokens (prompt + completion).
        vocab_size: token ids must lie in ``[0, vocab_size)``.

    Returns:
        ``req.max_tokens``, or the default: 16 for completions (clipped to the room left),
        the whole room left for chat.

    Raises:
        ApiError: 400 if a token id is out of range, the prompt leaves no room for one
        generated token, or prompt + ``max_tokens`` exceeds ``max_model_len``.
    """
    n = len(prompt_token_ids)
    if isinstance(req.prompt, list):
        bad = [t for t in req.prompt if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(f"Token id {bad[0]} is out of range [0, {vocab_size}).",
                           param="prompt", code="invalid_value")
    room = max_model_len - n
    if room < 1:
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, your prompt has {n} tokens, leaving no room for a "
                       f"completion.", param="prompt" if req.kind == "completion"
                       else "messages", code="context_length_exceeded")
    if req.max_tokens is None:
        return min(DEFAULT_COMPLETION_MAX_TOKENS, room) if req.kind == "completion" else room
    if req.max_tokens > room:
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, you requested {n + req.max_tokens} tokens ({n} in the "
                       f"prompt, {req.max_tokens} in the completion). Please reduce the "
                       f"prompt or the completion length.", param="max_tokens",
                       code="context_length_exceeded")
    return req.max_tokens
