"""Seeded workload generators: multi-round QA and long-document QA.

A workload is a list of ``Request`` objects, fully determined by its parameters and seed, so
every configuration of one run replays exactly the same requests. Prompts are token-id tuples
(ids drawn from ``[TOKEN_LOW, TOKEN_HIGH)``, valid and non-special for the SmolLM2 vocabulary of
49152) or, with ``prompt_format="text"``, strings made of words from a fixed word list.

Timing model: ``Request.arrival_s`` is the nominal send time in seconds after the start of the
run; a request with ``after`` set is sent no earlier than the completion of that request (a chat
user asks round r+1 only once round r was answered).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

#: Token ids used for synthetic prompts: [TOKEN_LOW, TOKEN_HIGH) avoids the special tokens (ids
#: < 17 in SmolLM2) and stays inside every vocabulary of >= 40000 tokens.
TOKEN_LOW = 1000
TOKEN_HIGH = 40000

#: Common English words for text prompts (each one is a single word-level piece in most BPEs).
WORDS = tuple("""
the of and to in is was for on that with as by at from his her an be this are which or had
not but have were one all their there been has when who will more no if out so said what up its
about into than them can only other new some could time these two may then do first any my now
such like our over man me even most made after also did many before must through back years
where much your way well down should because each just those people how too little state good
very make world still own see men work long get here between both life being under never day
same another know while last might us great old year off come since against go came right used
take three small house water place city river light field night music story paper table window
garden letter market school answer number system report question reason sound ocean winter
summer morning evening mountain village teacher student doctor station engine bridge forest
""".split())


@dataclass(frozen=True)
class Request:
    """One request of a workload.

    Attributes:
        request_id: unique name, e.g. ``"u3-r2"`` or ``"d1-q0"``.
        arrival_s: nominal send time, seconds after the run starts (>= 0).
        prompt: token ids (tuple of ints) or text.
        max_tokens: tokens to generate (sent with ``ignore_eos`` so the count is exact).
        session: the user or document the request belongs to.
        index: round number (multi-round QA) or question number (long-document QA).
        after: request id that must have completed before this one is sent, or ``None``.
    """

    request_id: str
    arrival_s: float
    prompt: tuple[int, ...] | str
    max_tokens: int
    session: str
    index: int
    after: str | None = None

    @property
    def num_prompt_tokens(self) -> int | None:
        """Prompt length in tokens for token-id prompts, ``None`` for text."""
        return len(self.prompt) if isinstance(self.prompt, tuple) else None


def _rng(seed: int, *stream: int) -> np.random.Generator:
    """An independent generator per (seed, stream...) so adding one part changes no other."""
    return np.random.default_rng([seed, *stream])


def random_tokens(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    """``n`` token ids drawn uniformly from ``[TOKEN_LOW, TOKEN_HIGH)``."""
    if n < 0:
        raise ValueError(f"token count must be >= 0, got {n}")
    return tuple(int(t) for t in rng.integers(TOKEN_LOW, TOKEN_HIGH, size=n))


def random_words(rng: np.random.Generator, n: int) -> str:
    """``n`` words from ``WORDS`` joined by spaces, with a leading space (so texts concatenate
    without merging words across the join)."""
    if n < 0:
        raise ValueError(f"word count must be >= 0, got {n}")
    idx = rng.integers(0, len(WORDS), size=n)
    return "".join(" " + WORDS[i] for i in idx)


def _piece(rng: np.random.Generator, n: int, prompt_format: str):
    if prompt_format == "tokens":
        return random_tokens(rng, n)
    if prompt_format == "text":
        return random_words(rng, n)
    raise ValueError(f"prompt_format must be 'tokens' or 'text', got {prompt_format!r}")


def _check_positive(**kwargs) -> None:
    for name, value in kwargs.items():
        if value is None or value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True)
class MultiRoundQA:
    """Multi-round chat (the shape of LMCache's multi-round QA benchmark).

    ``num_users`` users each hold ``num_rounds`` rounds. Round r of user u sends
    ``system + context_u + (question_0 + answer_0) + ... + question_r`` where ``system`` is
    ``system_tokens`` long and shared by all users, ``context_u`` is ``context_tokens`` long,
    each question is ``question_tokens`` long and each answer ``answer_tokens`` long. The answers
    in the history are seeded synthetic tokens (not the model's reply), so all configurations
    see identical prompts; the server is asked for ``answer_tokens`` new tokens per round.

    Requests are issued round-major (round 0 of every user, then round 1, ...) at ``qps``
    requests per second; round r+1 of a user waits for round r to finish.
    Sizes in tokens (or words with ``prompt_format="text"``).
    """

    num_users: int = 5
    num_rounds: int = 4
    system_tokens: int = 64
    context_tokens: int = 1024
    question_tokens: int = 24
    answer_tokens: int = 8
    qps: float = 1.0
    seed: int = 0
    prompt_format: str = "tokens"

    def __post_init__(self):
        _check_positive(num_users=self.num_users, num_rounds=self.num_rounds,
                        question_tokens=self.question_tokens, answer_tokens=self.answer_tokens,
                        qps=self.qps)
        if self.system_tokens < 0 or self.context_tokens < 0:
            raise ValueError("system_tokens and context_tokens must be >= 0")
        _piece(_rng(0), 0, self.prompt_format)  # validates the format

    def requests(self) -> list[Request]:
        """All requests in send order. Deterministic in the parameters."""
        fmt = self.prompt_format
        system = _piece(_rng(self.seed, 0), self.system_tokens, fmt)
        histories = [system + _piece(_rng(self.seed, 1, u), self.context_tokens, fmt)
                     for u in range(self.num_users)]
        out: list[Request] = []
        for r in range(self.num_rounds):
            for u in range(self.num_users):
                question = _piece(_rng(self.seed, 2, u, r), self.question_tokens, fmt)
                prompt = histories[u] + question
                out.append(Request(
                    request_id=f"u{u}-r{r}", arrival_s=len(out) / self.qps, prompt=prompt,
                    max_tokens=self.answer_tokens, session=f"u{u}", index=r,
                    after=f"u{u}-r{r - 1}" if r > 0 else None))
                answer = _piece(_rng(self.seed, 3, u, r), self.answer_tokens, fmt)
                histories[u] = prompt + answer
        return out

    @property
    def working_set_tokens(self) -> int:
        """Tokens of KV needed to keep every user's full history (final prompts + answers)."""
        per_user = self.context_tokens + self.num_rounds * (self.question_tokens
                                                             + self.answer_tokens)
        return self.system_tokens + self.num_users * per_user


@dataclass(frozen=True)
class LongDocQA:
    """Questions over long documents (the shape of LMCache's long-document QA benchmark).

    ``num_docs`` documents of ``doc_tokens`` tokens; each gets ``questions_per_doc`` questions of
    ``question_tokens`` tokens; a request's prompt is ``document + question``. Order:
    ``"interleaved"`` asks question 0 of every document, then question 1, ...; ``"shuffled"``
    is a seeded permutation. All requests arrive at t=0; the replay keeps at most
    ``max_inflight`` in flight (that bound belongs to the replay, it is recorded here so that
    the workload's parameters are in one place).
    """

    num_docs: int = 2
    doc_tokens: int = 2048
    questions_per_doc: int = 4
    question_tokens: int = 24
    answer_tokens: int = 8
    order: str = "interleaved"
    max_inflight: int = 1
    seed: int = 0
    prompt_format: str = "tokens"

    def __post_init__(self):
        _check_positive(num_docs=self.num_docs, doc_tokens=self.doc_tokens,
                        questions_per_doc=self.questions_per_doc,
                        question_tokens=self.question_tokens, answer_tokens=self.answer_tokens,
                        max_inflight=self.max_inflight)
        if self.order not in ("interleaved", "shuffled"):
            raise ValueError(f"order must be 'interleaved' or 'shuffled', got {self.order!r}")
        _piece(_rng(0), 0, self.prompt_format)

    def requests(self) -> list[Request]:
        """All requests in send order. Deterministic in the parameters."""
        fmt = self.prompt_format
        docs = [_piece(_rng(self.seed, 10, d), self.doc_tokens, fmt) for d in range(self.num_docs)]
        pairs = [(d, q) for q in range(self.questions_per_doc) for d in range(self.num_docs)]
        if self.order == "shuffled":
            perm = _rng(self.seed, 11).permutation(len(pairs))
            pairs = [pairs[i] for i in perm]
        return [Request(request_id=f"d{d}-q{q}", arrival_s=0.0,
                        prompt=docs[d] + _piece(_rng(self.seed, 12, d, q), self.question_tokens,
                                                fmt),
                        max_tokens=self.answer_tokens, session=f"d{d}", index=q)
                for d, q in pairs]


def first_in_session(requests: Sequence[Request]) -> set[str]:
    """Ids of the requests that are the first of their session in send order (cold by design:
    nothing before them could be reused apart from a shared system prompt)."""
    seen: set[str] = set()
    first: set[str] = set()
    for r in requests:
        if r.session not in seen:
            seen.add(r.session)
            first.add(r.request_id)
    return first
