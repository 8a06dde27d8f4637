"""A request's prompt as the engine will run it: token ids, then block hashes per engine.

The token ids come from the same functions ``engine_min.serve.server`` prepares a request with:
``engine_min.serve.protocol.parse_completion_request`` / ``parse_chat_request`` (the same
validation and message normalisation), the model's ``Tokenizer.apply_chat_template(messages,
add_generation_prompt=True)`` for chats and ``Tokenizer.encode`` (no BOS) for text; a prompt
given as token ids is used as is. Block hashes are ``engine_min.block_hash.block_hashes`` under
each engine's ``(hash_seed, block_size)``.

Synchronous and CPU-bound (a 2k-token prompt takes about a millisecond to tokenize): the proxy
runs ``prepare_prompt`` on a worker thread.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from jinja2 import TemplateError

from engine_min.block_hash import block_hashes
from engine_min.serve import protocol as proto

#: text longer than this (characters) is not tokenized by the router (routed by load): it is
#: far beyond any context, and the engine refuses it without tokenizing it either
MAX_PROMPT_CHARS = 4 * 2**20

HashKey = tuple[bytes, int]  # (hash_seed, block_size)


@dataclass(frozen=True)
class PreparedPrompt:
    """What the router knows of a request's prompt.

    Attributes:
        token_ids: the prompt's token ids, or None when the body cannot be parsed, validated or
            tokenized (the engine then answers its own error).
        hashes: chained block hashes of ``token_ids`` per ``(hash_seed, block_size)`` asked for.
    """

    token_ids: list[int] | None
    hashes: dict[HashKey, list[bytes]] = field(default_factory=dict)


def prompt_token_ids(tokenizer, raw: bytes, kind: str) -> list[int] | None:
    """Token ids of the prompt of request body ``raw`` (``kind``: ``completion`` | ``chat``),
    exactly as the engine computes them; None when the engine would refuse the body (invalid
    JSON or fields, a template error, text too long or not tokenizable)."""
    try:
        body = proto.loads_body(raw)
        if kind == "chat":
            req = proto.parse_chat_request(body)
            if sum(len(m["content"]) for m in req.messages) > MAX_PROMPT_CHARS:
                return None
            text = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
        else:
            req = proto.parse_completion_request(body)
            if not isinstance(req.prompt, str):
                return list(req.prompt)
            if len(req.prompt) > MAX_PROMPT_CHARS:
                return None
            text = req.prompt
        return list(tokenizer.encode(text))
    except (proto.ApiError, ValueError, TypeError, TemplateError):
        return None


def prepare_prompt(tokenizer, raw: bytes, kind: str, keys: Iterable[HashKey]) -> PreparedPrompt:
    """``prompt_token_ids`` and its block hashes under each of ``keys``."""
    ids = prompt_token_ids(tokenizer, raw, kind)
    if ids is None:
        return PreparedPrompt(None)
    try:
        hashes = {key: block_hashes(key[0], ids, key[1]) for key in set(keys)}
    except ValueError:  # a token id outside [0, 2**32): the engine refuses it
        return PreparedPrompt(None)
    return PreparedPrompt(ids, hashes)
