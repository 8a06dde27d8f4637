"""KV events of the prefix cache: the event log's numbering, window and snapshot; replaying a
block manager's events rebuilds its cached hashes exactly (random admissions, evictions,
frees, resets); on the real model under a tiny pool (evictions and preemptions) the engine's
published batches equal its prefix cache, and the HTTP routes serve them; a served engine
stopped by SIGTERM answers its open long poll and exits at once."""
import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from engine_min.block_hash import block_hashes
from engine_min.block_manager import BlockManager
from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, EventGap,
                                  KVEventLog, apply_event)
from engine_min.sampler import SamplingParams
from engine_min.sequence import Sequence
from engine_min.serve.server import ServerThread, create_app

BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4          # one 16-token KV block of SmolLM2-135M in fp32


def _replay(batches_or_events) -> set[bytes]:
    cached: set[bytes] = set()
    for e in batches_or_events:
        apply_event(cached, e)
    return cached


# ---------------------------------------------------------------- the log
def test_log_numbers_batches_and_keeps_a_window():
    log = KVEventLog(max_batches=3)
    assert log.publish([]) is None and log.latest_seq == 0       # empty steps: no batch
    a, b, c = (bytes([i]) * 16 for i in range(3))
    for h in (a, b, c):
        log.publish([BlockStored((h,), None, __import__("array").array("I", [1] * 4), 4)])
    log.publish([BlockRemoved((a,))])
    assert log.latest_seq == 4
    assert [x.seq for x in log.since(1)] == [2, 3, 4]             # window of 3: 2..4
    assert [x.seq for x in log.since(3)] == [4] and log.since(4) == []
    with pytest.raises(EventGap, match="no longer retained"):
        log.since(0)                                              # batch 1 dropped
    with pytest.raises(EventGap, match="outside"):
        log.since(5)                                              # ahead of the log
    with pytest.raises(EventGap, match="epoch"):
        log.since(4, epoch="another-process")
    snap = log.snapshot()
    assert (snap.seq, set(snap.block_hashes)) == (4, {b, c})
    log.publish([AllBlocksCleared()])
    assert log.snapshot().block_hashes == [] and log.snapshot().seq == 5
    with pytest.raises(ValueError):
        KVEventLog(max_batches=0)


def test_block_stored_wire_form():
    import array
    h0, h1 = b"\x01" * 16, b"\x02" * 16
    e = BlockStored((h1,), h0, array.array("I", [5, 6, 7, 8]), 4)
    assert e.to_json() == {"type": "BlockStored", "block_hashes": ["02" * 16],
                           "parent_block_hash": "01" * 16, "token_ids": [5, 6, 7, 8],
                           "block_size": 4, "lora_id": None, "medium": "GPU"}
    assert BlockRemoved((h0,)).to_json() == {"type": "BlockRemoved", "block_hashes": ["01" * 16],
                                             "medium": "GPU"}


# ---------------------------------------------------------------- the block manager
def _admit(bm: BlockManager, seq: Sequence) -> bool:
    hits = bm.lookup(seq)
    if not bm.can_allocate(seq, seq.num_tokens, hits):
        return False
    bm.allocate(seq, seq.num_tokens, hits)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_blocks(seq)
    return True


def test_block_manager_events_replay_to_its_cache_exactly():
    rng = random.Random(7)
    bm = BlockManager(num_blocks=24, block_size=4, hash_seed=b"seed", enable_kv_events=True)
    prefixes = [[rng.randrange(1000) for _ in range(12)] for _ in range(4)]
    live: list[Sequence] = []
    events: list = []
    stored = removed = 0
    for step in range(400):
        op = rng.random()
        if op < 0.55:
            ids = rng.choice(prefixes)[:rng.randrange(0, 13)] + \
                [rng.randrange(1000) for _ in range(rng.randrange(1, 14))]
            seq = Sequence(f"r{step}", ids, SamplingParams(max_tokens=1))
            if _admit(bm, seq):
                live.append(seq)
        elif op < 0.97 and live:
            bm.free_seq(live.pop(rng.randrange(len(live))))     # finished or preempted
        elif not live:
            bm.reset_prefix_cache()
        batch = bm.take_events()
        events += batch
        stored += sum(len(e.block_hashes) for e in batch if isinstance(e, BlockStored))
        removed += sum(len(e.block_hashes) for e in batch if isinstance(e, BlockRemoved))
        assert _replay(events) == set(bm.hash_to_block), f"diverged at step {step}"
        bm.check_integrity()
    assert stored > 100 and removed > 50                          # the walk evicted for real
    assert any(isinstance(e, AllBlocksCleared) for e in events)


def test_block_stored_runs_carry_parent_and_tokens():
    bm = BlockManager(num_blocks=10, block_size=2, hash_seed=b"s", enable_kv_events=True)
    ids = [1, 2, 3, 4, 5, 6, 7]
    a = Sequence("a", ids[:4], SamplingParams(max_tokens=1))
    assert _admit(bm, a)
    (first,) = bm.take_events()
    b = Sequence("b", ids, SamplingParams(max_tokens=1))
    assert _admit(bm, b)                                          # hits 2 blocks, stores 1 more
    (second,) = bm.take_events()
    h = block_hashes(b"s", ids, 2)
    assert first.block_hashes == tuple(h[:2]) and first.parent_block_hash is None
    assert list(first.token_ids) == [1, 2, 3, 4]
    assert second.block_hashes == (h[2],) and second.parent_block_hash == h[1]
    assert list(second.token_ids) == [5, 6] and second.block_size == 2


def test_events_off_records_nothing():
    bm = BlockManager(num_blocks=6, block_size=2, hash_seed=b"s")
    assert _admit(bm, Sequence("a", [1, 2, 3], SamplingParams(max_tokens=1)))
    assert bm.take_events() == [] and len(bm.hash_to_block) == 1


# ---------------------------------------------------------------- the real engine
PROMPTS = ["The capital of Germany is", "Once upon a time, there was a", "def fibonacci(n):",
           "The best way to learn physics is", "List three colors:", "Water boils at"]


@pytest.fixture(scope="module")
def small_engine():
    # 10 usable 16-token blocks: long prompts evict each other's blocks and preempt
    return LLMEngine(EngineConfig(kv_cache_bytes=BLOCK_BYTES * 11, max_num_batched_tokens=64,
                                  kv_event_batches=100_000))


def test_engine_batches_match_its_prefix_cache_under_evictions_and_preemptions(small_engine):
    eng = small_engine
    log = eng.kv_event_log
    tok = eng.tokenizer
    long_prompts = [tok.encode((p + " ") * 12)[:40] for p in PROMPTS]   # 2 full blocks + 8
    outs = eng.generate(long_prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert all(len(o.output_token_ids) == 20 for o in outs)
    assert eng.stats()["num_preemptions"] > 0
    batches = log.since(0)
    events = [e for b in batches for e in b.events]
    assert [b.seq for b in batches] == list(range(1, log.latest_seq + 1))
    assert any(isinstance(e, BlockRemoved) for e in events)         # evictions happened
    assert _replay(events) == set(eng.block_manager.hash_to_block)
    assert set(log.snapshot().block_hashes) == set(eng.block_manager.hash_to_block)
    # a prompt's hashes computed by a subscriber are the engine's own
    ids = long_prompts[-1] + outs[-1].output_token_ids
    mine = block_hashes(eng.block_manager.hash_seed, ids, eng.config.block_size)
    assert set(mine) & set(eng.block_manager.hash_to_block)
    assert eng.reset_prefix_cache()
    assert isinstance(log.since(log.latest_seq - 1)[0].events[-1], AllBlocksCleared)
    assert log.snapshot().block_hashes == [] and not eng.block_manager.hash_to_block


def test_routes_long_poll_snapshot_and_gap(small_engine):
    eng = small_engine
    with ServerThread(create_app(eng, "m")) as srv:
        async def run():
            async with aiohttp.ClientSession() as s:
                snap = await (await s.get(f"{srv.url}/v1/kv_events/snapshot")).json()
                assert snap["block_size"] == 16
                assert snap["hash_seed"] == eng.block_manager.hash_seed.hex()
                seq, epoch = snap["seq"], snap["epoch"]
                # a long poll waits for the next batch, which a completion produces
                poll = asyncio.ensure_future(s.get(
                    f"{srv.url}/v1/kv_events?after={seq}&timeout=20&epoch={epoch}"))
                await asyncio.sleep(0.3)
                assert not poll.done()
                prompt = eng.tokenizer.encode("Tell me a story about a red fox. " * 4)[:35]
                r = await s.post(f"{srv.url}/v1/completions",
                                 json={"prompt": prompt, "max_tokens": 2})
                assert r.status == 200
                body = await (await poll).json()
                assert body["epoch"] == epoch and body["batches"][0]["seq"] == seq + 1
                stored = [h for b in body["batches"] for e in b["events"]
                          if e["type"] == "BlockStored" for h in e["block_hashes"]]
                want = [h.hex() for h in block_hashes(eng.block_manager.hash_seed, prompt, 16)]
                assert stored[:2] == want                           # the prompt's 2 full blocks
                snap2 = await (await s.get(f"{srv.url}/v1/kv_events/snapshot")).json()
                assert set(want) <= set(snap2["block_hashes"])
                assert snap2["seq"] == body["latest_seq"] or snap2["seq"] > seq
                # nothing new: an immediate empty answer
                idle = await (await s.get(f"{srv.url}/v1/kv_events?after={snap2['seq']}")).json()
                assert idle["batches"] == []
                gone = await s.get(f"{srv.url}/v1/kv_events?after=0&epoch=other")
                assert gone.status == 410
                assert (await gone.json())["error"]["code"] == "kv_events_gap"
                bad = await s.get(f"{srv.url}/v1/kv_events?after=x")
                assert bad.status == 400 and "error" in json.loads(await bad.text())
                neg = await s.get(f"{srv.url}/v1/kv_events?after=0&timeout=-1")
                assert neg.status == 400
        asyncio.run(run())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_ends_an_open_long_poll_at_once():
    """``python -m engine_min serve`` with a subscriber's 30 s long poll open: SIGTERM answers
    the poll (200, no batches) and the process exits within 5 s (well under the poll's 30 s, with
    room for a loaded host), instead of waiting the poll out."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_min", "serve", "--port", str(port), "--kv-cache-bytes",
         str(BLOCK_BYTES * 40), "--max-model-len", "256", "--log-level", "warning"],
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "engine not healthy"
            try:
                with urllib.request.urlopen(url + "/v1/kv_events/snapshot", timeout=5) as r:
                    snap = json.loads(r.read())
                break
            except OSError:
                time.sleep(0.3)
        answer: dict = {}

        def poll() -> None:
            with urllib.request.urlopen(f"{url}/v1/kv_events?after={snap['seq']}&epoch="
                                        f"{snap['epoch']}&timeout=30", timeout=60) as r:
                answer.update(status=r.status, body=json.loads(r.read()), at=time.monotonic())

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        time.sleep(1.0)   # the poll is waiting on the engine
        assert poller.is_alive() and not answer
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        exit_s = time.monotonic() - t0
        poller.join(5)
        assert exit_s < 5.0, exit_s
        assert answer["status"] == 200 and answer["at"] - t0 < 5.0
        assert answer["body"]["batches"] == [] and answer["body"]["epoch"] == snap["epoch"]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        proc.stderr.close()
