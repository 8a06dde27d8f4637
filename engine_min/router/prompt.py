"""A request's prompt as the engine will run it: token ids, then block hashes per engine.

The token ids come from the same functions ``engine_min.serve.server`` prepares a request with:
``engine_min.serve.protocol.parse_completion_request`` / ``parse_chat_request`` (the same
validation and message normalisation), the model's ``Tokenizer.apply_chat_template(messages,
add_generation_prompt=True)`` for chats and ``Tokenizer.encode`` (no BOS) for text; a prompt
given as token ids is used as is. Block hashes are ``engine_min.block_hash.block_hashes`` under
each engine's ``(hash_seed, block_size)``.

Synchronous and CPU-bound (the byte-level BPE takes about 4 ms of CPU for a 2k-token text on
the 2-core test machine): ``PromptEncoder`` caches the token ids of the text between special
tokens, and the proxy runs ``prompt_source`` then ``prepare_source`` on a worker thread unless
the body is small and its text has little not yet cached (``num_uncached_chars``). The tokenizer
splits text at its special tokens (``<|im_start|>``, ``<|im_end|>``) before anything else and
encodes each piece on its own, so encoding piece by piece gives the same ids; a chat's next
round repeats its history piece for piece, and only the new messages are tokenized.
"""
from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
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
    #: ``token_ids`` as a uint32 array when block hashes were computed (the store's chunk
    #: keys reuse it: the list -> array conversion is most of their cost), else None
    id_array: np.ndarray | None = field(default=None, compare=False, repr=False)


class PromptEncoder:
    """``tokenizer.encode`` with an LRU cache of the pieces of text between special tokens.

    Used only when every added token of the tokenizer is special, matched on the raw text
    (not normalized) and without strip or single-word options (the GGUF tokenizers'), where
    the pieces are encoded independently; otherwise ``encode`` is the tokenizer's own.
    Thread-safe.

    Args:
        tokenizer: an ``engine_min.tokenizer.Tokenizer``.
        max_cached_chars: characters of text kept in the cache (ids are about a quarter).
    """

    def __init__(self, tokenizer, max_cached_chars: int = 16 * 2**20):
        self.tokenizer, self.max_cached_chars = tokenizer, max_cached_chars
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self._specials: dict[str, int] = {}
        self._split = None
        # the backend's added tokens; engine_min's Tokenizer has no public accessor for them
        added = tokenizer._tok.get_added_tokens_decoder()
        if added and all(t.special and not t.normalized and not t.lstrip and not t.rstrip
                         and not t.single_word for t in added.values()):
            self._specials = {t.content: i for i, t in added.items()}
            alternation = "|".join(re.escape(t) for t in sorted(self._specials, key=len,
                                                                reverse=True))
            self._split = re.compile(f"({alternation})")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, equal to ``tokenizer.encode(text)``. Raises ValueError as
        it does (text that is not valid Unicode)."""
        if self._split is None:
            return list(self.tokenizer.encode(text))
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # a special token
                ids.append(self._specials[piece])
            elif piece:
                ids += self._piece(piece)
        return ids

    def num_uncached_chars(self, text: str) -> int:
        """Characters of ``text`` that ``encode`` would tokenize (not in the cache): all of
        it when the cache is not used. Changes nothing (not the pieces' recency)."""
        if self._split is None:
            return len(text)
        pieces = self._split.split(text)[::2]
        with self._lock:
            return sum(len(p) for p in pieces if p not in self._cache)

    def _piece(self, piece: str) -> list[int]:
        with self._lock:
            hit = self._cache.get(piece)
            if hit is not None:
                self._cache.move_to_end(piece)
                return hit
        ids = list(self.tokenizer.encode(piece))
        if len(piece) <= self.max_cached_chars:
            with self._lock:
                if piece not in self._cache:
                    self._cache[piece] = ids
                    self._chars += len(piece)
                while self._chars > self.max_cached_chars:
                    old, _ = self._cache.popitem(last=False)
                    self._chars -= len(old)
        return ids


def prompt_source(tokenizer, raw: bytes, kind: str) -> str | list[int] | None:
    """The prompt of request body ``raw`` (``kind``: ``completion`` | ``chat``) as the engine
    reads it before tokenizing: its text (chat template applied) or its token ids; None when
    the engine would refuse the body (invalid JSON or fields, a template error, text too
    long)."""
    try:
        body = proto.loads_body(raw)
        if kind == "chat":
            req = proto.parse_chat_request(body)
            if sum(len(m["content"]) for m in req.messages) > MAX_PROMPT_CHARS:
                return None
            return tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
        req = proto.parse_completion_request(body)
        if not isinstance(req.prompt, str):
            return list(req.prompt)
        return req.prompt if len(req.prompt) <= MAX_PROMPT_CHARS else None
    except (proto.ApiError, ValueError, TypeError, TemplateError):
        return None


def source_token_ids(tokenizer, source: str | list[int] | None,
                     encoder: PromptEncoder | None = None) -> list[int] | None:
    """Token ids of a ``prompt_source`` (text through ``encoder``, or ``tokenizer.encode``
    when None); None for None or text that cannot be tokenized."""
    if not isinstance(source, str):
        return source
    try:
        return encoder.encode(source) if encoder is not None else list(tokenizer.encode(source))
    except (ValueError, TypeError):
        return None


def prompt_token_ids(tokenizer, raw: bytes, kind: str,
                     encoder: PromptEncoder | None = None) -> list[int] | None:
    """Token ids of the prompt of request body ``raw`` (``kind``: ``completion`` | ``chat``),
    exactly as the engine computes them; None when the engine would refuse the body (invalid
    JSON or fields, a template error, text too long or not tokenizable). ``encoder``: a
    ``PromptEncoder`` of ``tokenizer`` (None: ``tokenizer.encode``)."""
    return source_token_ids(tokenizer, prompt_source(tokenizer, raw, kind), encoder)


def prepare_source(tokenizer, source: str | list[int] | None, keys: Iterable[HashKey],
                   encoder: PromptEncoder | None = None) -> PreparedPrompt:
    """``source_token_ids`` of a ``prompt_source`` and its block hashes under each of
    ``keys``."""
    ids = source_token_ids(tokenizer, source, encoder)
    if ids is None:
        return PreparedPrompt(None)
    keys = set(keys)
    if not keys:
        return PreparedPrompt(ids)
    try:
        # one uint32 copy of the ids for every key: about 3x cheaper than the list -> int64
        # conversion ``block_hashes`` makes of a list (80 us of its 160 for 2k tokens)
        arr = np.frombuffer(array("I", ids), dtype=np.uint32)
    except (OverflowError, TypeError):  # a token id outside [0, 2**32): the engine refuses it
        return PreparedPrompt(None)
    return PreparedPrompt(ids, {key: block_hashes(key[0], arr, key[1]) for key in keys}, arr)


def prepare_prompt(tokenizer, raw: bytes, kind: str, keys: Iterable[HashKey],
                   encoder: PromptEncoder | None = None) -> PreparedPrompt:
    """``prompt_token_ids`` and its block hashes under each of ``keys``."""
    return prepare_source(tokenizer, prompt_source(tokenizer, raw, kind), keys, encoder)
