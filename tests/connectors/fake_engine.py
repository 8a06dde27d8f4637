"""Stand-in engine for connector tests: engine_min's real Scheduler and BlockManager with a
stand-in forward pass (no model): the "computed" KV of token t at position p is ``kv_value(t, p)``,
so every slot of the pool says whether it was computed, loaded, or never written.

Block size 4 throughout.
"""
from __future__ import annotations

import torch

from connectors.engine_min import EngineMinConnector
from engine_min.block_manager import BlockManager
from engine_min.sampler import SamplingParams
from engine_min.scheduler import Scheduler
from engine_min.sequence import Sequence
from kernels import reference as K
from kvstore.config import StoreConfig
from kvstore.store import ChunkStore


L, H, D, BS = 2, 1, 2, 4
STORE_MARK = 1000.0  # KV put straight into the store = computed value + STORE_MARK


def kv_value(tokens: list[int], start: int, end: int, mark: float = 0.0) -> torch.Tensor:
    """``[L, 2, end - start, H, D]`` KV of tokens[start:end]: value = token * 10 + position (+ mark)."""
    t = torch.tensor(tokens[start:end], dtype=torch.float32)
    p = torch.arange(start, end, dtype=torch.float32)
    v = (t * 10 + p + mark)[None, None, :, None, None]
    return v.expand(L, 2, end - start, H, D).contiguous()


class FakeEngine:
    """Scheduler + block manager + pool; ``forward`` writes kv_value into computed slots."""

    def __init__(self, connector, num_blocks=64, budget=512, prefix_caching=True):
        self.kv = torch.full((L, 2, num_blocks, BS, H, D), -1.0)
        self.bm = BlockManager(num_blocks, BS, prefix_caching)
        self.sched = Scheduler(self.bm, budget, 8, connector)
        self.conn = connector
        self.computed_tokens = 0
        self.tables: dict[str, list[int]] = {}   # last block table of each request
        connector.register_kv_caches(self.kv, BS)

    def add(self, rid, tokens, max_tokens=1) -> Sequence:
        seq = Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens))
        self.sched.add(seq)
        return seq

    def step(self):
        out = self.sched.schedule()
        self.conn.start_load_kv(out, self.kv)
        self.conn.wait_for_load()
        for it in out.scheduled:
            s, n = it.seq.num_computed_tokens, it.num_new_tokens
            kv = kv_value(it.seq.token_ids, s, s + n)
            pos = torch.arange(s, s + n)
            slots = torch.tensor(it.seq.block_table)[pos // BS] * BS + pos % BS
            for layer in range(L):
                K.reshape_and_cache(kv[layer, 0], kv[layer, 1], self.kv[layer], slots)
            self.computed_tokens += n
        self.conn.save(out, self.kv)
        for it in out.scheduled:
            self.tables[it.seq.request_id] = list(it.seq.block_table)
        for it in out.scheduled:
            seq, samples = it.seq, it.samples
            seq.num_computed_tokens += it.num_new_tokens
            self.bm.cache_blocks(seq)
            if samples:
                seq.token_ids.append(7 + seq.num_output_tokens)
                if seq.num_output_tokens >= seq.sampling.max_tokens:
                    self.sched.finish(seq, "length")
        return out

    def run(self, max_steps=100):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("did not finish")

    def seq_kv(self, seq, start, end) -> torch.Tensor:
        """KV of seq's tokens [start, end) read back from its blocks."""
        pos = torch.arange(start, end)
        blocks = torch.tensor(self.tables[seq.request_id])[pos // BS]
        return self.kv[:, :, blocks, pos % BS]


def make_store(cpu="1MiB") -> ChunkStore:
    return ChunkStore(StoreConfig(cpu_bytes=cpu))


def make_conn(store=None, chunk=8, **kw) -> EngineMinConnector:
    return EngineMinConnector(store or make_store(), chunk_size=chunk, deadline_s=5.0, **kw)


def prompt(n, base=100):
    return [base + i for i in range(n)]
