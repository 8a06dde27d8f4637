"""LLMEngine: requests in, tokens out. engine -> scheduler -> block manager; model runner ->
model -> kernels."""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
from typing import TYPE_CHECKING

import torch

from engine_min.block_manager import BlockManager
from engine_min.kv_events import KVEventLog
from engine_min.config import EngineConfig
from engine_min.identity import load_identity
from engine_min.model import LlamaModel
from engine_min.model_runner import ModelRunner
from engine_min.sampler import Sampler, SamplingParams, apply_penalties
from engine_min.scheduler import Scheduler
from engine_min.sequence import RequestOutput, SeqFailure, Sequence
from engine_min.step_isolation import execute_isolated
from engine_min.tokenizer import load_tokenizer
from engine_min.weights import default_model_path, load_model, open_gguf

if TYPE_CHECKING:
    from connectors.base import KVConnectorBase

logger = logging.getLogger(__name__)


class LLMEngine:
    """A paged-attention engine over one Llama-family model on ``config.device`` (weights, KV
    pool, step inputs and logits there; the sampled token ids come back once per step).

    Args:
        config: engine settings.
        connector: optional KV connector (seams in scheduler.py and model_runner.py).

    Attributes:
        tokenizer: encode / decode / apply_chat_template / eos_token_id.
        model_config: ModelConfig (num_layers, num_kv_heads, head_dim, max_position, ...).
        kv_cache: the KV pool ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
            on ``config.device``.
        max_model_len: longest prompt + output (model context, config cap and pool size).
        kv_identity: what changes the KV of the same token ids (model id, revision, weights
            fingerprint, dtype, RoPE...; ``engine_min.identity.kv_identity``), strings.

    Raises:
        ModelLoadError: the model cannot be found or is unsupported.
        ValueError: the KV pool is smaller than two blocks.
    """

    def __init__(self, config: EngineConfig | None = None,
                 connector: KVConnectorBase | None = None):
        self.config = config = config or EngineConfig()
        self.model_path = config.model or default_model_path()
        gguf = str(self.model_path).endswith(".gguf") and os.path.isfile(self.model_path)
        reader = open_gguf(self.model_path) if gguf else None
        self.model_config, sd = load_model(self.model_path, reader)  # GGUF header parsed once
        self.tokenizer = load_tokenizer(self.model_path, reader)
        self.kv_identity = load_identity(self.model_path, reader, config, self.model_config)
        del reader
        self.model = LlamaModel(self.model_config, sd, config.torch_dtype, config.device)
        del sd
        mc, dtype = self.model_config, config.torch_dtype
        block_bytes = mc.kv_block_bytes(config.block_size, dtype.itemsize)
        num_blocks = config.kv_cache_bytes // block_bytes
        if num_blocks < 2:
            raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds {num_blocks} blocks of "
                             f"{block_bytes} bytes; at least 2 are needed (null block + 1)")
        self.kv_cache = torch.zeros(mc.num_layers, 2, num_blocks, config.block_size,
                                    mc.num_kv_heads, mc.head_dim, dtype=dtype,
                                    device=config.device)
        self.max_model_len = min(config.max_model_len or mc.max_position, mc.max_position,
                                 (num_blocks - 1) * config.block_size)
        seed = hashlib.sha256(f"engine_min-v1|{self.model_path}|{config.dtype}".encode()).digest()
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching, seed,
                                          enable_kv_events=config.enable_kv_events)
        #: the prefix cache's KV events, one batch per step (``engine_min.kv_events``); None
        #: with ``enable_kv_events`` off
        self.kv_event_log = (KVEventLog(config.kv_event_batches) if config.enable_kv_events
                             else None)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens,
                                   config.max_num_seqs)
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size)
        self.connector = None
        self.set_connector(connector)
        self.sampler = Sampler(config.seed)
        self.eos_token_id = self.tokenizer.eos_token_id
        if self.eos_token_id is None:
            self.eos_token_id = mc.eos_token_id
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []  # aborts, reported by the next step()
        self._ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_failed_requests = 0

    def set_connector(self, connector: KVConnectorBase | None) -> None:
        """Attach a KV connector (or detach with None) at all three seams: engine (stats),
        scheduler (admission) and model runner (load / save), and bind it to the KV pool with
        ``connector.register_model(kv_identity)`` and
        ``connector.register_kv_caches(kv_cache, block_size)`` (a ``KVConnectorBase``).

        Raises:
            RuntimeError: requests are still running or waiting (their connector state would
                be split between two connectors); nothing is changed then.
        """
        if self.scheduler.has_unfinished():
            raise RuntimeError("set_connector while requests are unfinished; "
                               "finish or abort them first")
        self.connector = self.scheduler.connector = self.runner.connector = connector
        if connector is not None:
            connector.register_model(self.kv_identity)  # what changes the KV: the namespace
            connector.register_kv_caches(self.kv_cache, self.config.block_size)

    def reset_prefix_cache(self) -> bool:
        """Drop the engine's own prefix cache (cached block hashes; the KV store behind a
        connector is untouched). Returns False, changing nothing, while requests are
        unfinished."""
        if self.scheduler.has_unfinished():
            return False
        done = self.block_manager.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def _publish_kv_events(self) -> None:
        """Move the block manager's events into ``kv_event_log`` as one batch."""
        if self.kv_event_log is not None:
            self.kv_event_log.publish(self.block_manager.take_events())

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; returns its id.

        Raises:
            ValueError: empty prompt, prompt too long for max_model_len, token ids outside
                the vocabulary, a duplicate request_id or bad sampling params. Nothing is
                queued then; other requests are untouched.
        """
        sampling = sampling if sampling is not None else SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        ids = self._prompt_ids(prompt)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seq = Sequence(request_id, ids, sampling)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt has token ids outside [0, {vocab}): {bad[:5]}")
        else:
            raise ValueError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             "(prompt + at least one output token must fit)")
        return ids

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if unknown or already finished."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        seq.finish_time = time.perf_counter()
        self._pending.append(RequestOutput.of(seq, []))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward pass; one output per request that got a token or finished.

        A fault stays with its request: an error raised admitting (connector), computing (the
        forward pass; policy in ``engine_min.step_isolation``), sampling, stop-checking or
        detokenizing one sequence finishes that request alone with finish reason ``"error"``
        (``RequestOutput.error`` says where and why; its blocks are freed); the rest of the
        batch goes on as if it had not been there.

        The step's prefix-cache events (blocks cached, evicted) go to ``kv_event_log`` as one
        batch, also when the step raises.
        """
        try:
            return self._step()
        finally:
            self._publish_kv_events()

    def _step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        outputs, self._pending = self._pending, []
        outputs += [self._fail(f) for f in sched.failed]
        if sched.is_empty:
            return outputs
        res = execute_isolated(self.runner, sched)
        outputs += [self._fail(f) for f in res.failed]
        samplers = [it for it in res.ordered if it.samples]
        logits = self._suppress_early_stops(res.logits, [it.seq for it in samplers])
        logits = apply_penalties(logits, [it.seq.sampling for it in samplers],
                                 [(it.seq.token_ids, it.seq.num_prompt_tokens) for it in samplers])
        tokens = self.sampler.sample_rows(logits, [it.seq.sampling for it in samplers],
                                          [it.seq.generator for it in samplers]) if samplers else []
        sampled = dict(zip((id(it.seq) for it in samplers), tokens))
        for it in res.ordered:
            try:
                self._advance(it)
            except Exception as exc:  # noqa: BLE001 - fails this request alone
                outputs.append(self._fail(SeqFailure(it.seq, "cache", exc)))
                continue
            token = sampled.get(id(it.seq))
            if isinstance(token, Exception):
                outputs.append(self._fail(SeqFailure(it.seq, "sample", token)))
            elif token is not None:
                outputs.append(self._append_token(it.seq, token))
        return outputs

    def _suppress_early_stops(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """``min_tokens``: ``logits [len(seqs), vocab]``, or a copy where the EOS (unless
        ``ignore_eos``) and ``stop_token_ids`` of each sequence with fewer than ``min_tokens``
        output tokens hold the dtype's lowest finite value, so neither argmax nor a draw picks
        them (a finite value: the sampler refuses rows with infinite logits)."""
        low, copied = None, False
        for row, seq in enumerate(seqs):
            p = seq.sampling
            if seq.num_output_tokens >= p.min_tokens:
                continue
            ids = list(p.stop_token_ids)
            if not p.ignore_eos and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
            ids = [t for t in ids if t < logits.shape[-1]]
            if ids:
                if not copied:  # the forward's output is an inference tensor: no in-place
                    logits, copied = logits.clone(), True
                    low = torch.finfo(logits.dtype).min
                logits[row, ids] = low
        return logits

    def _advance(self, it) -> None:
        """Count a completed prompt, move ``num_computed_tokens`` past this step's tokens and
        publish the sequence's newly full blocks in the prefix cache."""
        seq = it.seq
        if it.num_new_tokens == seq.num_tokens - seq.num_computed_tokens and \
                seq.num_output_tokens == 0:
            self.num_prompt_tokens += seq.num_prompt_tokens
        seq.num_computed_tokens += it.num_new_tokens
        self.block_manager.cache_blocks(seq)

    def _append_token(self, seq: Sequence, token: int) -> RequestOutput:
        now = time.perf_counter()
        seq.token_ids.append(token)
        self.num_generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        prev_len = len(seq.text.rstrip("\ufffd"))  # a partial UTF-8 tail may change
        try:
            seq.text = self._detokenize(seq)
        except Exception as exc:  # noqa: BLE001 - fails this request alone
            return self._fail(SeqFailure(seq, "detokenize", exc))
        try:
            reason = self._stop_reason(seq, token, prev_len)
        except Exception as exc:  # noqa: BLE001 - fails this request alone
            return self._fail(SeqFailure(seq, "stop", exc))
        if reason is not None:
            self.scheduler.finish(seq, reason)
            seq.finish_time = now
            self._seqs.pop(seq.request_id, None)
        return RequestOutput.of(seq, [token])

    def _detokenize(self, seq: Sequence) -> str:
        """The text of seq's output tokens."""
        return self.tokenizer.decode(seq.output_token_ids)

    def _stop_reason(self, seq: Sequence, token: int, prev_len: int) -> str | None:
        """``"stop"`` / ``"length"`` when ``token`` (just appended) ends seq, else None, as
        vLLM decides: no EOS / stop id before ``min_tokens`` outputs, stop strings only once
        more than ``min_tokens`` were generated and only in the text new since ``prev_len``
        characters (and the overlap a stop string needs). A stop string is cut from
        ``seq.text`` (kept with ``include_stop_str_in_output``), so is a stop token's text;
        ``seq.stop_reason`` becomes the matched stop string or token id (None for EOS)."""
        p = seq.sampling
        if seq.num_output_tokens >= p.min_tokens:
            eos = token == self.eos_token_id and not p.ignore_eos
            if eos or token in p.stop_token_ids:
                seq.stop_reason = None if eos else token
                if not p.include_stop_str_in_output:
                    seq.text = self.tokenizer.decode(seq.output_token_ids[:-1])
                return "stop"
        if p.stop and seq.num_output_tokens > p.min_tokens:
            hit = _find_stop(seq.text, p.stop, prev_len)
            if hit is not None:
                cut, stop = hit
                seq.text = seq.text[:cut + len(stop) if p.include_stop_str_in_output else cut]
                seq.stop_reason = stop
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _fail(self, failure: SeqFailure) -> RequestOutput:
        """Finish ``failure.seq`` alone with finish reason ``"error"`` (blocks freed; the
        connector saves only KV computed before the failing step) and report it."""
        seq = failure.seq
        seq.error = failure.describe()
        logger.error("request %s failed: %s", seq.request_id, seq.error,
                     exc_info=(type(failure.error), failure.error, failure.error.__traceback__))
        self.scheduler.finish(seq, "error")
        seq.finish_time = time.perf_counter()
        self._seqs.pop(seq.request_id, None)
        self.num_failed_requests += 1
        return RequestOutput.of(seq, [])

    def generate(self, prompts: list[str | list[int]] | str,
                 sampling: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` to completion; final outputs in prompt order.

        Raises:
            ValueError: a bad prompt or params (no request of this call is left queued).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.add_request(p, sp))
        except ValueError:
            for rid in ids:
                self.abort(rid)
            self._pending = [o for o in self._pending if o.request_id not in ids]
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in ids]

    def stats(self) -> dict:
        """Counters and gauges: queue sizes, KV pool use, prefix-cache queries/hits (tokens;
        each request counted once, at its first admission; re-admissions after a preemption
        apart in ``prefix_cache_preempted_*``), failed requests, and the connector's
        ``get_stats()`` (``external_prefix_cache_*``, ``kvstore_*``) when one is attached."""
        bm = self.block_manager
        total = bm.num_blocks - 1
        extra = self.connector.get_stats() if self.connector is not None else {}
        return {**extra,
                "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "kv_blocks_used": bm.num_used_blocks, "kv_blocks_total": total,
                "kv_usage": bm.num_used_blocks / total,
                "prefix_cache_queries_tokens": bm.num_query_tokens,
                "prefix_cache_hits_tokens": bm.num_hit_tokens,
                "prefix_cache_preempted_queries_tokens": bm.num_preempted_query_tokens,
                "prefix_cache_preempted_hits_tokens": bm.num_preempted_hit_tokens,
                "num_failed_requests": self.num_failed_requests,
                "num_prompt_tokens": self.num_prompt_tokens,
                "num_generated_tokens": self.num_generated_tokens,
                "num_preemptions": self.scheduler.num_preemptions,
                "kv_pool_bytes": self.kv_cache.numel() * self.kv_cache.element_size()}


def _find_stop(text: str, stops: list[str], prev_len: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends past ``prev_len`` (text before it was
    searched already) as ``(index, stop string)``, or None."""
    found = [(i, s) for s in stops
             if (i := text.find(s, max(0, prev_len - len(s) + 1))) >= 0]
    return min(found, key=lambda f: f[0]) if found else None
