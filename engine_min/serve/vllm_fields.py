"""vLLM's request fields beyond OpenAI's, for ``engine_min.serve.protocol``: the ones the server
implements as vLLM does, and the ones it refuses (400 ``unsupported``, naming the field) because
they would change the output and the engine does not implement them.

Implemented (vLLM's ``CompletionRequest`` / ``ChatCompletionRequest`` semantics):

- ``min_tokens`` (int, 0 up to ``max_tokens``): EOS and ``stop_token_ids`` are not sampled,
  and stop strings not matched, before that many tokens were generated;
- ``repetition_penalty`` (number > 0, default 1), ``min_p`` (0 to 1, default 0) and OpenAI's
  ``presence_penalty`` / ``frequency_penalty`` (-2 to 2, default 0), as vLLM's sampler
  (``engine_min.sampler``: penalties on the raw logits, greedy rows too; ``min_p`` after
  temperature);
- ``include_stop_str_in_output`` (bool): a matched stop string (or a stop token's text) stays
  in the text, streamed too;
- ``truncate_prompt_tokens`` (int >= 1, or -1 for ``max_model_len``; at most
  ``max_model_len``): only the last k prompt tokens are run and counted in ``usage``;
- ``stream_options.continuous_usage_stats`` (bool, with ``include_usage``): every chunk carries
  the usage so far;
- chat ``add_generation_prompt`` (default true) and ``continue_final_message`` (default false;
  the last message is left open for the model to continue; both true is a 400).

Refused unless they hold vLLM's default (``REFUSED``): ``length_penalty`` (1),
``use_beam_search``, ``allowed_token_ids``, ``bad_words``, ``logits_processors``,
``prompt_logprobs``, ``prompt_embeds``, ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``, ``structured_outputs``, ``skip_special_tokens`` (true),
``spaces_between_special_tokens`` (true), ``priority`` (0), ``vllm_xargs``, and for chat
``echo``, ``chat_template``, ``chat_template_kwargs`` and ``documents``. Fields that do not
change the output (``user``, ``request_id``, ``cache_salt``, ``add_special_tokens``: the
model's tokenizer adds no special tokens to text, ``return_tokens_as_token_ids`` without
logprobs, ...) are accepted and have no effect.
"""
from __future__ import annotations

import math
from typing import Any

from engine_min.serve.protocol import ApiError

#: field -> the values accepted (vLLM's defaults; a JSON null always means the default)
REFUSED: dict[str, tuple] = {
    "length_penalty": (1, 1.0),
    "use_beam_search": (False,), "allowed_token_ids": ([],), "bad_words": ([],),
    "logits_processors": ([],), "prompt_logprobs": (), "prompt_embeds": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "structured_outputs": (), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "priority": (0,), "vllm_xargs": ({},),
}
#: chat-only refusals (on ``/v1/completions`` ``echo`` is refused by ``protocol``)
REFUSED_CHAT: dict[str, tuple] = {
    "echo": (False,), "chat_template": (), "chat_template_kwargs": ({},), "documents": ([],),
}


def _same(v: Any, allowed: tuple) -> bool:
    # bool is an int in Python: True must not pass as 1 (nor 1 as True)
    return any(type(v) is type(a) and v == a for a in allowed) or (
        isinstance(v, float) and not isinstance(v, bool)
        and any(not isinstance(a, bool) and isinstance(a, (int, float)) and v == a
                for a in allowed))


def refuse_unimplemented(body: dict, kind: str) -> None:
    """Raise ``ApiError`` (400 ``unsupported``, ``param`` the field) for the first field of
    ``REFUSED`` (and ``REFUSED_CHAT`` for ``kind == "chat"``) that is present, not null and
    not one of its default values."""
    table = {**REFUSED, **REFUSED_CHAT} if kind == "chat" else REFUSED
    for name, allowed in table.items():
        v = body.get(name)
        if v is not None and not _same(v, allowed):
            shown = " or ".join(repr(a) for a in allowed)
            raise ApiError(f"'{name}' is not supported" + (f" (only {shown})" if shown else "")
                           + "; the engine would ignore it.", param=name, code="unsupported")


def _opt(body: dict, name: str, check, expected: str):
    v = body.get(name)
    if v is None:
        return None
    if not check(v):
        raise ApiError(f"'{name}' must be {expected}.", param=name, code="invalid_type")
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


#: number field -> (lowest, highest, whether the lowest is excluded), vLLM's ranges
SAMPLING_RANGES: dict[str, tuple[float, float, bool]] = {
    "repetition_penalty": (0.0, math.inf, True), "min_p": (0.0, 1.0, False),
    "presence_penalty": (-2.0, 2.0, False), "frequency_penalty": (-2.0, 2.0, False),
}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_vllm_sampling(body: dict, max_tokens: int | None) -> dict:
    """``SamplingParams`` keywords of ``min_tokens``, ``include_stop_str_in_output`` and the
    numbers of ``SAMPLING_RANGES`` (only those present and not null). Raises ``ApiError``
    (400, ``param`` the field): wrong types, a number out of its range (NaN and infinity too),
    ``min_tokens`` below 0 or above ``max_tokens`` (when given; else checked once the
    default is known)."""
    kw: dict = {}
    for name, (lo, hi, open_lo) in SAMPLING_RANGES.items():
        v = _opt(body, name, _is_number, "a number")
        if v is None:
            continue
        if not (math.isfinite(v) and (lo < v if open_lo else lo <= v) and v <= hi):
            want = f"greater than {lo:g}" if open_lo else f"in [{lo:g}, {hi:g}]"
            raise ApiError(f"'{name}' must be {want}, got {v}.", param=name,
                           code="invalid_value")
        kw[name] = float(v)
    min_tokens = _opt(body, "min_tokens", _is_int, "an integer")
    if min_tokens is not None:
        if min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
            raise ApiError(f"'min_tokens' must be in [0, max_tokens], got {min_tokens}.",
                           param="min_tokens", code="invalid_value")
        kw["min_tokens"] = min_tokens
    inc = _opt(body, "include_stop_str_in_output", _is_bool, "a boolean")
    if inc is not None:
        kw["include_stop_str_in_output"] = inc
    return kw


def parse_request_options(body: dict, kind: str, stream_options: dict) -> dict:
    """``ApiRequest`` keywords: ``truncate_prompt_tokens`` (None, -1 or >= 1),
    ``continuous_usage`` (bool), and for chat ``add_generation_prompt`` /
    ``continue_final_message``. Raises ``ApiError`` (400) for wrong types or values."""
    k = _opt(body, "truncate_prompt_tokens", _is_int, "an integer")
    if k is not None and (k == 0 or k < -1):
        raise ApiError("'truncate_prompt_tokens' must be -1 (the model's context) or at "
                       f"least 1, got {k}.", param="truncate_prompt_tokens",
                       code="invalid_value")
    cont = _opt(stream_options, "continuous_usage_stats", _is_bool, "a boolean")
    out = {"truncate_prompt_tokens": k, "continuous_usage": bool(cont)}
    if kind == "chat":
        agp, cfm = chat_template_flags(body)
        out.update(add_generation_prompt=agp, continue_final_message=cfm)
    return out


def chat_template_flags(body: dict) -> tuple[bool, bool]:
    """``(add_generation_prompt, continue_final_message)`` of a chat body (defaults true,
    false). Raises ``ApiError`` (400): not booleans, or both true (as vLLM)."""
    agp = _opt(body, "add_generation_prompt", _is_bool, "a boolean")
    cfm = bool(_opt(body, "continue_final_message", _is_bool, "a boolean"))
    agp = True if agp is None else agp
    if agp and cfm:
        raise ApiError("Cannot set both `continue_final_message` and `add_generation_prompt` "
                       "to True.", param="continue_final_message", code="invalid_value")
    return agp, cfm


def truncate_prompt(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """The last ``k`` of ``ids`` (-1: ``max_model_len``; None or k >= len: unchanged).
    Raises ``ApiError`` (400) when ``k`` exceeds ``max_model_len``, as vLLM."""
    if k is None:
        return ids
    if k > max_model_len:
        raise ApiError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                       f"({max_model_len}). Please select a smaller truncation size.",
                       param="truncate_prompt_tokens", code="invalid_value")
    k = max_model_len if k == -1 else k
    return ids[-k:] if k < len(ids) else ids


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool,
                continue_final_message: bool) -> str:
    """The chat template's text for ``messages``; with ``continue_final_message`` it ends
    right after the last message's content (HF ``apply_chat_template``'s rule: the template's
    end-of-turn text is cut off). Raises ``ValueError`` when the template drops that content."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    if not continue_final_message:
        return text
    final = messages[-1]["content"]
    if final.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not "
                         "appear in the chat after applying the chat template")
    at = text.rindex(final.strip())
    if text[at:at + len(final.lstrip())] == final:
        return text[:at + len(final.lstrip())]
    return text[:at + len(final.strip())]
