"""A request's state inside the engine (Sequence) and what the engine reports (RequestOutput).

Token ranges of one sequence (``num_tokens = len(prompt) + len(output)``)::

    [0 ........ num_cached_tokens)                      prefix-cache hits (+ connector loads)
    [0 ................ num_computed_tokens)            KV in the sequence's blocks
    [num_computed_tokens ...... num_tokens)             still to compute (prefill chunks, or
                                                        the one newest token when decoding)
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from engine_min.sampler import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request: its tokens, blocks and progress.

    Attributes:
        request_id: caller-visible id.
        token_ids: prompt then output token ids.
        num_prompt_tokens: prompt length.
        sampling: the request's SamplingParams.
        num_computed_tokens: tokens whose KV is in ``block_table`` (reset to 0 on preemption).
        block_table: KV block ids in token order.
        block_hashes: chained hashes of the full blocks of token_ids (filled lazily).
        num_cached_tokens: prompt tokens not computed at the last admission (hits + loaded).
        num_preemptions: times the sequence was preempted (0 until its first preemption; a
            re-admission is any admission after one).
        error: why the request failed (``"<stage>: <ExceptionType>: <message>"``, finish
            reason ``"error"``), else None.
        generator: per-request torch.Generator when ``sampling.seed`` is set.
        stop_reason: the stop string or stop token id that finished it, else None.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.error: str | None = None
        self.finish_reason: str | None = None
        self.text = ""
        self.stop_reason: str | int | None = None
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.generator = (torch.Generator().manual_seed(sampling.seed)
                          if sampling.seed is not None else None)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.value})")


@dataclass
class SeqFailure:
    """A sequence that failed alone during one step.

    Attributes:
        seq: the sequence.
        stage: where: ``"admit"`` (connector at admission), ``"forward"`` (its forward pass,
            alone), ``"sample"``, ``"stop"`` (stop checks) or ``"detokenize"``.
        error: the exception raised.
    """

    seq: Sequence
    stage: str
    error: BaseException

    def describe(self) -> str:
        """``"<stage>: <ExceptionType>: <message>"``."""
        return f"{self.stage}: {type(self.error).__name__}: {self.error}"


@dataclass
class RequestOutput:
    """One request's progress, reported by ``LLMEngine.step``.

    Attributes:
        request_id: the request.
        prompt_token_ids: the prompt.
        output_token_ids: every output token so far.
        new_token_ids: tokens produced this step.
        text: decoded output so far (cut before a matched stop string).
        finished: no more tokens will come.
        finish_reason: "stop" (EOS, stop id or string), "length" (max_tokens or max_model_len),
            "abort", "error" (this request failed alone: ``error`` says why), or None while
            running.
        num_prompt_tokens: prompt length.
        num_cached_tokens: prompt tokens not computed (engine prefix-cache hits + connector loads).
        arrival_time / first_token_time / finish_time: ``time.perf_counter()`` stamps
            (TTFT = first_token_time - arrival_time).
        error: with finish_reason "error", the stage and exception that failed the request
            (``"sample: ValueError: ..."``); None otherwise.
        stop_reason: the matched stop string or stop token id (vLLM's ``stop_reason``); None
            for EOS, length, abort or error.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None
    stop_reason: str | int | None = None

    @classmethod
    def of(cls, seq: Sequence, new_token_ids: list[int]) -> "RequestOutput":
        return cls(seq.request_id, seq.prompt_token_ids, seq.output_token_ids, list(new_token_ids),
                   seq.text, seq.is_finished, seq.finish_reason, seq.num_prompt_tokens,
                   seq.num_cached_tokens, seq.arrival_time, seq.first_token_time, seq.finish_time,
                   seq.error, seq.stop_reason)
