"""``POST /tokenize`` and ``POST /detokenize`` of ``engine_min.serve.server``, with vLLM's request and
response shapes (``vllm/entrypoints/serve/tokenize/protocol.py``), so clients that check their
token counts against the server's (``vllm bench serve`` aligns its prompts this way) work.

``/tokenize`` takes either a text prompt (vLLM's ``TokenizeCompletionRequest``)::

    {"model"?: str, "prompt": str, "add_special_tokens"?: bool = true,
     "return_token_strs"?: bool = false}

or chat messages (``TokenizeChatRequest``; rendered with the model's chat template exactly as
``/v1/chat/completions`` renders them)::

    {"model"?: str, "messages": [...], "add_generation_prompt"?: bool = true,
     "continue_final_message"?: false, "add_special_tokens"?: bool = false,
     "return_token_strs"?: bool = false}

and answers ``{"count": int, "max_model_len": int, "tokens": [int], "token_strs": [str] | null}``
(``token_strs``: the vocabulary strings, e.g. ``"Ġworld"``, as HF ``convert_ids_to_tokens``).
The ids are exactly those ``/v1/completions`` / ``/v1/chat/completions`` run for the same
prompt, so ``count`` equals their ``usage.prompt_tokens``. ``add_special_tokens`` is accepted
and changes nothing: the engine's tokenizer adds no BOS/EOS to text (the model's own tokenizer
adds none either), and special tokens written in the text are always recognised.

``/detokenize`` takes ``{"model"?: str, "tokens": [int]}`` and answers ``{"prompt": str}``
(special tokens kept, as vLLM's ``tokenizer.decode``).

``continue_final_message`` leaves the last message open (no end of turn, no generation prompt;
``vllm_fields.render_chat``), as the chat endpoint does.

Errors are OpenAI error objects: 400 for a bad body (``continue_final_message`` together with
``add_generation_prompt``; a custom ``chat_template`` and ``tools`` are not supported; token ids must lie in ``[0, vocab_size)``),
404 ``model_not_found`` for another model's name.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

from aiohttp import web
from jinja2 import TemplateError

from engine_min.serve import protocol as proto
from engine_min.serve.errors import error_response
from engine_min.serve.vllm_fields import chat_template_flags, render_chat

if TYPE_CHECKING:
    from engine_min.serve.server import OpenAIServing


def _opt_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise proto.ApiError(f"'{name}' must be a boolean.", param=name, code="invalid_type")
    return v


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise proto.ApiError("'model' must be a string.", param="model", code="invalid_type")
    return model


def _refuse_unsupported_chat_fields(body: dict) -> None:
    for name in ("chat_template", "tools"):
        if body.get(name) is not None:
            raise proto.ApiError(f"'{name}' is not supported.", param=name,
                                 code="unsupported")


class TokenizeRoutes:
    """The two handlers, over the serving object's tokenizer, model check and limits."""

    def __init__(self, serving: "OpenAIServing"):
        self.serving = serving
        self.tokenizer = serving.tokenizer

    # ---- the work (pure, off the event loop) ------------------------------------------------
    def tokenize_body(self, raw: bytes) -> dict:
        """The ``/tokenize`` answer for request body ``raw``. Raises ``ApiError``."""
        body = proto.loads_body(raw)
        self.serving.check_model(_model(body))
        has_prompt, has_messages = body.get("prompt") is not None, "messages" in body
        if has_prompt == has_messages:
            raise proto.ApiError("Give either 'prompt' (a string) or 'messages'.",
                                 param="prompt", code="missing_field" if not has_prompt
                                 else "invalid_value")
        _opt_bool(body, "add_special_tokens", not has_messages)  # type-checked; see module doc
        if has_messages:
            ids = self._chat_ids(body)
        else:
            if not isinstance(body["prompt"], str):
                raise proto.ApiError("'prompt' must be a string.", param="prompt",
                                     code="invalid_type")
            ids = self._text_ids(body["prompt"], "prompt")
        strs = self._token_strs(ids) if _opt_bool(body, "return_token_strs", False) else None
        return {"count": len(ids), "max_model_len": self.serving.max_model_len,
                "tokens": ids, "token_strs": strs}

    def _chat_ids(self, body: dict) -> list[int]:
        _refuse_unsupported_chat_fields(body)
        agp, cfm = chat_template_flags(body)
        messages = proto.parse_messages(body)
        self.serving.check_text_length(sum(len(m["content"]) for m in messages), "messages")
        try:
            text = render_chat(self.tokenizer, messages, agp, cfm)
        except (ValueError, TypeError, TemplateError) as exc:
            raise proto.ApiError(f"The chat template rejected the messages: {exc}",
                                 param="messages", code="invalid_value") from exc
        return self._text_ids(text, "messages", check_chars=False)

    def _text_ids(self, text: str, param: str, check_chars: bool = True) -> list[int]:
        if check_chars:
            self.serving.check_text_length(len(text), param)
        return self.serving.encode(text, param)

    def _token_strs(self, ids: list[int]) -> list[str]:
        # the vocabulary strings (HF convert_ids_to_tokens); engine_min's Tokenizer exposes
        # no id -> token string lookup of its own, so its tokenizers backend answers
        return [self.tokenizer._tok.id_to_token(i) for i in ids]

    def detokenize_body(self, raw: bytes) -> dict:
        """The ``/detokenize`` answer for request body ``raw``. Raises ``ApiError``."""
        body = proto.loads_body(raw)
        self.serving.check_model(_model(body))
        tokens = body.get("tokens")
        if tokens is None:
            raise proto.ApiError("'tokens' is required.", param="tokens", code="missing_field")
        if not (isinstance(tokens, list)
                and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
            raise proto.ApiError("'tokens' must be a list of token ids.", param="tokens",
                                 code="invalid_type")
        vocab_size = self.serving.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise proto.ApiError(f"Token id {bad[0]} is out of range [0, {vocab_size}).",
                                 param="tokens", code="invalid_value")
        return {"prompt": self.tokenizer.decode(tokens, skip_special_tokens=False)}

    # ---- handlers ----------------------------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._answer(request, self.tokenize_body)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._answer(request, self.detokenize_body)

    async def _answer(self, request: web.Request, work: Callable[[bytes], Any]
                      ) -> web.Response:
        raw = await request.read()
        try:  # off the event loop: a long text takes a while to tokenize
            out = await asyncio.get_running_loop().run_in_executor(None, work, raw)
        except proto.ApiError as exc:
            return error_response(exc)
        return web.json_response(out)


def add_tokenize_routes(app: web.Application, serving: "OpenAIServing") -> TokenizeRoutes:
    """Register ``POST /tokenize`` and ``POST /detokenize`` on ``app``."""
    routes = TokenizeRoutes(serving)
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)
    return routes
