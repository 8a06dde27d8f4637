"""Request preparation of ``engine_min.serve.server.OpenAIServing``: a body is validated
(``engine_min.serve.protocol``), checked against the served model names and the context, and
tokenized (a chat through the model's chat template, ``vllm_fields.render_chat``; the prompt
cut to ``truncate_prompt_tokens``), then turned into ``SamplingParams``. Runs on the default
thread pool, never on the event loop.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from engine_min.serve import protocol as proto
from engine_min.serve.vllm_fields import render_chat, truncate_prompt

#: generous upper bound of characters per token: a text prompt (or the messages' content) longer
#: than ``max_model_len * MAX_CHARS_PER_TOKEN`` characters cannot fit the context, so it is
#: refused before the tokenizer spends seconds on it (a 4.8 MB prompt took 3.6 s).
MAX_CHARS_PER_TOKEN = 64
#: with ``truncate_prompt_tokens`` a text is tokenized whatever its length, then cut; up to this
#: many characters (or the limit above, if larger), a hard cap on the tokenizer's time and memory
MAX_TRUNCATED_TEXT_CHARS = 4 * 2**20


@dataclass
class Prepared:
    """A validated, tokenized request ready for the engine."""

    req: proto.ApiRequest
    request_id: str
    prompt_token_ids: list[int]
    sampling: Any
    created: int = field(default_factory=lambda: int(time.time()))


class RequestPreparation:
    """Mixin of ``OpenAIServing``: needs ``tokenizer``, ``model_names``, ``max_model_len`` and
    ``vocab_size`` attributes. Every method raises ``proto.ApiError`` for a request it
    refuses."""

    tokenizer: Any
    model_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int

    def _prepare(self, raw: bytes, kind: str) -> Prepared:
        from engine_min.sampler import SamplingParams

        body = proto.loads_body(raw)
        if kind == "chat":
            req = proto.parse_chat_request(body)
        else:
            req = proto.parse_completion_request(body)
        self.check_model(req.model)
        self._check_chars(req)
        if req.kind == "chat":
            try:
                text = render_chat(self.tokenizer, req.messages, req.add_generation_prompt,
                                   req.continue_final_message)
            except (ValueError, TypeError, TemplateError) as exc:
                raise proto.ApiError(f"The chat template rejected the messages: {exc}",
                                     param="messages", code="invalid_value") from exc
            prompt_ids = self.encode(text, "messages")
        elif isinstance(req.prompt, str):
            prompt_ids = self.encode(req.prompt, "prompt")
        else:
            prompt_ids = list(req.prompt)
        prompt_ids = truncate_prompt(prompt_ids, req.truncate_prompt_tokens,
                                     self.max_model_len)
        if not prompt_ids:
            raise proto.ApiError("The prompt encodes to zero tokens.", param="prompt",
                                 code="empty_prompt")
        max_tokens = proto.check_context(req, prompt_ids, self.max_model_len, self.vocab_size)
        try:
            sampling = SamplingParams(max_tokens=max_tokens, **req.sampling)
        except (TypeError, ValueError) as exc:
            raise proto.ApiError(f"Invalid sampling parameters: {exc}", code="invalid_value",
                                 param="min_tokens" if "min_tokens" in str(exc) else None
                                 ) from exc
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return Prepared(req, f"{prefix}-{uuid.uuid4().hex}", prompt_ids, sampling)

    def check_model(self, model: str | None) -> None:
        """Refuse (404 ``model_not_found``) a request naming a model this server does not
        serve; ``None`` (no ``model`` field) means the served one."""
        if model is not None and model not in self.model_names:
            raise proto.ApiError(f"The model `{model}` does not exist.", param="model",
                                 code="model_not_found", status=404)

    def _check_chars(self, req: proto.ApiRequest) -> None:
        """Refuse text that cannot fit the context whatever it encodes to (400), before the
        tokenizer runs: more than ``max_model_len * MAX_CHARS_PER_TOKEN`` characters; with
        ``truncate_prompt_tokens`` (the text is cut after tokenizing) more than
        ``MAX_TRUNCATED_TEXT_CHARS``."""
        if req.kind == "chat":
            n, param = sum(len(m.get("content") or "") for m in req.messages), "messages"
        elif isinstance(req.prompt, str):
            n, param = len(req.prompt), "prompt"
        else:
            return
        if req.truncate_prompt_tokens is None:
            self.check_text_length(n, param)
            return
        limit = max(MAX_TRUNCATED_TEXT_CHARS, self.max_model_len * MAX_CHARS_PER_TOKEN)
        if n > limit:
            raise proto.ApiError(f"Your {param} {'have' if param == 'messages' else 'has'} {n} "
                                 f"characters; with truncate_prompt_tokens at most {limit} "
                                 f"characters are tokenized.", param=param,
                                 code="invalid_value")

    def check_text_length(self, num_chars: int, param: str) -> None:
        """Refuse (400 ``context_length_exceeded``) ``num_chars`` characters of text in field
        ``param`` when over ``max_model_len * MAX_CHARS_PER_TOKEN``."""
        limit = self.max_model_len * MAX_CHARS_PER_TOKEN
        if num_chars > limit:
            raise proto.ApiError(f"This model's maximum context length is {self.max_model_len} "
                                 f"tokens. However, your {param} "
                                 f"{'have' if param == 'messages' else 'has'} {num_chars} "
                                 f"characters, more than the {limit} characters that context "
                                 f"can hold.", param=param,
                                 code="context_length_exceeded")

    def encode(self, text: str, param: str) -> list[int]:
        """Token ids of ``text`` (request field ``param``); 400 if it cannot be tokenized."""
        try:
            return list(self.tokenizer.encode(text))
        except ValueError as exc:  # text the tokenizer cannot take (not valid Unicode)
            raise proto.ApiError(f"The {param} cannot be tokenized: {exc}", param=param,
                                 code="invalid_value") from exc
