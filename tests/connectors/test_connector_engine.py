"""EngineMinConnector on the real model (SmolLM2-135M, one engine for the module): greedy outputs
with the connector equal the engine's without it, and hit counts follow the chunk arithmetic.

Engine: block size 4, its own prefix cache off (so every reuse goes through the store) except
where a test turns it on. Store chunks: 16 tokens (4 and 8 where the arithmetic asks).
Connectors are swapped on the one engine with ``attach``. Tail pieces are off here
(``tail_chunk_size=0``): these are the full-chunk counts; the default (pieces of one block) is
tested in ``test_connector_tail``.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from connectors.engine_min import EngineMinConnector
from connectors.factory import create_connector
from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.sampler import SamplingParams
from kvstore.api import PrefixStore

ROOT = Path(__file__).resolve().parents[2]
BS, C = 4, 16
DOC_TOKENS = 94 * C          # 1,504 tokens, a whole number of chunks
DEADLINE = 60.0              # generous: exact counts must not depend on machine load


def greedy(n, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def attach(engine: LLMEngine, conn: EngineMinConnector | None) -> None:
    """Swap the engine's connector (all three seams) and bind it to the pool."""
    engine.set_connector(conn)


def run(engine, prompt_ids, n, **kw):
    """(output ids, num_cached_tokens) of one greedy request."""
    out = engine.generate([list(prompt_ids)], greedy(n, **kw))[0]
    return out.output_token_ids, out.num_cached_tokens


# ---- prompts -------------------------------------------------------------------------------
WORDS = ("river harbor council winter market bridge archive lantern orchard quarry signal "
         "meadow tower ledger compass garden furnace beacon canal granary").split()


def document_ids(tok) -> list[int]:
    """A deterministic ~1,500-token report, cut to exactly DOC_TOKENS tokens."""
    rng = random.Random(5)
    paras, ids = [], []
    i = 0
    while len(ids) < DOC_TOKENS + 50:
        a, b, c = rng.sample(WORDS, 3)
        paras.append(f"Section {i}. The {a} of district {rng.randint(2, 90)} was rebuilt in "
                     f"{rng.randint(1700, 1990)} next to the old {b}; records show {rng.randint(3, 900)} "
                     f"families used the {c} every {rng.choice(['spring', 'autumn', 'week'])}.")
        i += 1
        ids = tok.encode("Read the report and answer briefly.\n\n" + "\n".join(paras))
    return ids[:DOC_TOKENS]


QUESTIONS = ["\nQuestion: When was the harbor rebuilt?\nAnswer:",
             "\nQuestion: How many families used the orchard?\nAnswer:",
             "\nQuestion: Which district had the lantern?\nAnswer:",
             "\nQuestion: What was next to the old bridge?\nAnswer:"]


def chat_round1(tok) -> list[int]:
    """A chat-templated first round of exactly 100 tokens."""
    text = tok.apply_chat_template([{"role": "user", "content": (
        "I am planning a three day trip to a coastal town in autumn. I like old harbors, "
        "small museums, long walks and fish markets, and I do not drive. Please suggest a plan "
        "for each day, where to stay, what to eat, and what to pack for rain and wind. "
        "Also tell me which day is best for a boat tour and why.")}])
    ids = tok.encode(text)
    tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n")
    assert len(ids) > 100
    return ids[:100 - len(tail)] + tail


def next_turn(tok, text) -> list[int]:
    return tok.encode(f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


FOLLOWUPS = ["Make day two cheaper.", "Now shorten the whole plan to five lines."]
R1_TOKENS, RK_TOKENS, QA_TOKENS = 52, 8, 6


# ---- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(EngineConfig(block_size=BS, kv_cache_bytes=100 * 2**20,
                                 enable_prefix_caching=False))
    yield eng
    attach(eng, None)


@pytest.fixture(scope="module")
def baseline(engine):
    """The engine without a connector: chat rounds (prompts and outputs) and doc answers."""
    tok = engine.tokenizer
    attach(engine, None)
    chat, prompt = [], chat_round1(tok)
    for k in range(3):
        out, cached = run(engine, prompt, R1_TOKENS if k == 0 else RK_TOKENS, ignore_eos=k == 0)
        assert cached == 0
        chat.append((prompt, out))
        if k < 2:
            prompt = prompt + out + next_turn(tok, FOLLOWUPS[k])
    doc = document_ids(tok)
    engine.block_manager.enable_prefix_caching = True   # baseline: the engine's own cache only
    try:
        qa = [(doc + tok.encode(q), run(engine, doc + tok.encode(q), QA_TOKENS)[0])
              for q in QUESTIONS]
    finally:
        engine.block_manager.enable_prefix_caching = False
    return {"chat": chat, "doc": doc, "qa": qa}


def check_chat_and_doc(engine, baseline, conn, tier: str, questions=3):
    """Run the chat and the first ``questions`` doc questions through ``conn``; compare."""
    attach(engine, conn)
    try:
        stored = 0
        for k, (prompt, want) in enumerate(baseline["chat"]):
            out, cached = run(engine, prompt, R1_TOKENS if k == 0 else RK_TOKENS,
                              ignore_eos=k == 0)
            assert out == want, f"chat round {k + 1} differs with the {tier} connector"
            assert cached == min(stored, len(prompt) - 1), f"round {k + 1}"
            assert conn.wait_for_save(DEADLINE)
            stored = (len(prompt) + len(out) - 1) // C * C   # prompt + answer, last has no KV
        # the figure: prompt 100 + 52 generated -> round 2 reuses 151 // 16 * 16 = 144
        assert len(baseline["chat"][0][0]) == 100 and len(baseline["chat"][0][1]) == 52
        for k, (prompt, want) in enumerate(baseline["qa"][:questions]):
            out, cached = run(engine, prompt, QA_TOKENS)
            assert out == want, f"doc question {k + 1} differs with the {tier} connector"
            if k == 0:
                assert cached == 0
            else:   # the document and the first question's shared "\nQuestion:" chunk-floor
                assert cached == DOC_TOKENS, f"doc question {k + 1}"
            assert conn.wait_for_save(DEADLINE)
        st = engine.stats()
        chat_prompts = [len(p) for p, _ in baseline["chat"]]
        qa_prompts = [len(p) for p, _ in baseline["qa"][:questions]]
        assert st["external_prefix_cache_queries"] == sum(chat_prompts) + sum(qa_prompts)
        r3 = (chat_prompts[1] + len(baseline["chat"][1][1]) - 1) // C * C
        want_hits = 144 + r3 + DOC_TOKENS * (questions - 1)
        assert st["external_prefix_cache_hits"] == want_hits
        by_tier = st["kvstore_hit_tokens_by_tier"]   # the store's other tiers: at 0
        assert {t: n for t, n in by_tier.items() if n} == {tier: want_hits}
        assert st["kvstore_fallbacks"] == 0 and st["kvstore_dropped_save_chunks"] == 0
        assert st["kvstore_loaded_bytes"] > 0 and st["kvstore_saved_bytes"] > 0
    finally:
        attach(engine, None)


# ---- tests ---------------------------------------------------------------------------------
def test_cpu_tier_chat_and_doc_qa_match_no_connector(engine, baseline):
    conn = create_connector(cpu_bytes="512MiB", chunk_size=C, deadline_s=DEADLINE,
                            tail_chunk_size=0)
    check_chat_and_doc(engine, baseline, conn, "cpu")
    # a chunk removed from the middle of a stored prefix: the hit stops before it
    attach(engine, conn)
    try:
        prompt, want = baseline["chat"][1]
        ps = PrefixStore(conn.store, conn.ns)
        assert ps.lookup(prompt).num_hit_chunks == len(prompt) // C   # saved by round 2
        assert conn.store.remove(conn.ns, ps.keys(prompt)[4:5]) == 1   # tokens [64, 80)
        out, cached = run(engine, prompt, RK_TOKENS)
        assert (out, cached) == (want, 64)
    finally:
        attach(engine, None)
        conn.close()


def test_disk_tier_only_chat_and_doc_qa_match_no_connector(engine, baseline, tmp_path):
    conn = create_connector(disk_path=str(tmp_path / "disk"), disk_bytes="512MiB",
                            chunk_size=C, deadline_s=DEADLINE, tail_chunk_size=0)
    assert conn.store.config.tiers == ("disk",)
    check_chat_and_doc(engine, baseline, conn, "disk", questions=2)
    conn.close()


def test_prompt_prefilled_in_6_token_slices_stores_4_chunks_and_replays(engine, baseline):
    prompt = baseline["chat"][0][0][:16]
    want, _ = run(engine, prompt, 4)
    conn = create_connector(cpu_bytes="64MiB", chunk_size=4, deadline_s=DEADLINE,
                            tail_chunk_size=0)
    attach(engine, conn)
    engine.scheduler.max_num_batched_tokens = 6
    try:
        out, cached = run(engine, prompt, 1)
        assert (out, cached) == (want[:1], 0)
        assert conn.wait_for_save(DEADLINE)
        assert PrefixStore(conn.store, conn.ns).lookup(prompt).num_hit_chunks == 4
        out, cached = run(engine, prompt, 4, )
        assert (out, cached) == (want, 15)
    finally:
        engine.scheduler.max_num_batched_tokens = engine.config.max_num_batched_tokens
        attach(engine, None)
        conn.close()


@pytest.mark.parametrize("local,stored,loaded,at", [(16, 24, 8, 0), (20, 16, 0, 40)])
def test_engine_cache_hit_is_never_overwritten(engine, baseline, local, stored, loaded, at):
    prompt = baseline["chat"][1][0][at:at + 40]   # a prompt the engine's cache has not seen
    want, _ = run(engine, prompt, 2)
    conn = create_connector(cpu_bytes="64MiB", chunk_size=8, deadline_s=DEADLINE,
                            tail_chunk_size=0)
    attach(engine, conn)
    try:
        run(engine, prompt[:stored] + [prompt[stored]], 1)        # stores `stored` tokens
        assert conn.wait_for_save(DEADLINE)
        attach(engine, None)
        engine.block_manager.enable_prefix_caching = True
        run(engine, prompt[:local] + [prompt[local]], 1)          # engine caches `local`
        attach(engine, conn)
        before = engine.stats()["kvstore_loaded_tokens"]
        out, cached = run(engine, prompt, 2)
        assert (out, cached) == (want, max(local, stored))
        assert engine.stats()["kvstore_loaded_tokens"] - before == loaded
    finally:
        engine.block_manager.enable_prefix_caching = False
        attach(engine, None)
        conn.close()


# ---- remote daemon -------------------------------------------------------------------------
class Daemon:
    """``python -m kvstore serve --port 0`` in a subprocess."""

    def __init__(self, log: Path):
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--port", "0", "--cpu-bytes", "1GiB",
             "--log-level", "warning"], cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        out: list[str] = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline().decode()))
        t.start()
        t.join(60)
        assert out and "listening on http://" in out[0], log.read_text()[-2000:]
        self.url = out[0].strip().rsplit(" ", 1)[-1]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.log.close()


SECOND_ENGINE = textwrap.dedent("""
    import json, sys
    from connectors.factory import create_connector
    from engine_min.config import EngineConfig
    from engine_min.engine import LLMEngine
    from engine_min.sampler import SamplingParams
    url, prompt, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    conn = create_connector(url=url, chunk_size={C}, deadline_s={DEADLINE}, tail_chunk_size=0)
    eng = LLMEngine(EngineConfig(block_size={BS}, kv_cache_bytes=100 * 2**20,
                                 enable_prefix_caching=False), connector=conn)
    out = eng.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0))[0]
    st = eng.stats()
    conn.close()
    tiers = {{t: n for t, n in st["kvstore_hit_tokens_by_tier"].items() if n}}
    print(json.dumps({{"out": out.output_token_ids, "cached": out.num_cached_tokens,
                      "tiers": tiers}}))
""").format(C=C, DEADLINE=DEADLINE, BS=BS)


def test_remote_daemon_chat_doc_qa_and_a_second_engine_process(engine, baseline, tmp_path):
    d = Daemon(tmp_path / "daemon.log")
    try:
        conn = create_connector(url=d.url, chunk_size=C, deadline_s=DEADLINE, tail_chunk_size=0)
        check_chat_and_doc(engine, baseline, conn, "remote:cpu")
        conn.close()
        # another engine process asks a new question about the document: whole-document hit
        prompt, want = baseline["qa"][3]
        script = tmp_path / "second_engine.py"
        script.write_text(SECOND_ENGINE)
        res = subprocess.run([sys.executable, str(script), d.url, json.dumps(prompt),
                              str(QA_TOKENS)], cwd=ROOT, capture_output=True, text=True,
                             timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert res.returncode == 0, res.stderr[-3000:]
        got = json.loads(res.stdout.strip().splitlines()[-1])
        assert got == {"out": want, "cached": DOC_TOKENS, "tiers": {"remote:cpu": DOC_TOKENS}}
    finally:
        d.kill()


def test_daemon_killed_during_a_run_requests_complete_by_recompute(engine, baseline, tmp_path):
    d = Daemon(tmp_path / "daemon.log")
    conn = create_connector(url=d.url, chunk_size=C, deadline_s=2.0, tail_chunk_size=0)
    attach(engine, conn)
    try:
        (p1, w1), (p2, w2), (p3, w3) = baseline["chat"]
        assert run(engine, p2, 1)[0] == w2[:1]          # stores round 2's prompt chunks
        assert conn.wait_for_save(DEADLINE)
        r2 = engine.add_request(p2, greedy(RK_TOKENS))
        done, r3 = {}, None
        while len(done) < 2:
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
            if r3 is None:   # r2 was admitted with a hit and is decoding: kill the daemon
                d.kill()
                r3 = engine.add_request(p3, greedy(RK_TOKENS))
        assert done[r2].output_token_ids == w2 and done[r3].output_token_ids == w3
        assert done[r2].num_cached_tokens == min(len(p2) // C * C, len(p2) - 1)  # before the kill
        assert done[r3].num_cached_tokens == 0         # recomputed: lookup failed
        st = engine.stats()
        assert st["kvstore_lookup_fallbacks"] >= 1
    finally:
        attach(engine, None)
        d.kill()
        conn.close()
