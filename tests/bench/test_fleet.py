"""Two hosts share a document's KV through one Redis Cluster, on the real model.

Two ``engine_min serve`` processes, each on its own ``kvstore serve --remote-url`` daemon, both
daemons on one 3-master cluster, plus an engine without a store (the recompute reference);
engines run with their own prefix cache off. Host 1 reads a document; host 2 then answers a
question about it with the whole document loaded from Redis: daemon 2's CPU tier served
nothing, Redis served exactly the document's chunks, and the greedy answer is the one a full
recompute gives. Then ``python -m bench.fleet --quick --json`` runs whole.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.fleet import Asker, FleetWorkload
from bench.fleet_procs import FleetGroup, FleetOptions
from tests.redis_fixtures import redis_cluster, require_redis  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
DOC_TOKENS, CHUNK = 512, 64
NUM_CHUNKS = DOC_TOKENS // CHUNK  # 8


def _hits(st: dict) -> tuple[int, int, int]:
    """(chunks the CPU tier served, chunks the remote tier served, Redis values read)."""
    by_tier = st["hits_by_tier"]
    return by_tier.get("cpu", 0), by_tier.get("remote", 0), st["remote"]["hits"]


def _redis_keys(cluster) -> int:
    return sum(node.client().dbsize() for node in cluster.nodes)


def test_second_host_answers_from_redis_what_the_first_read(redis_cluster):  # noqa: F811
    wl = FleetWorkload(num_docs=1, doc_tokens=DOC_TOKENS)
    with FleetGroup(fleet=FleetOptions(chunk_size=CHUNK, kv_cache_bytes="48MiB"),
                    cluster=redis_cluster) as fleet:
        asker = Asker(fleet)
        try:
            want = asker.ask("engine0", wl.request(0, 1))        # recompute: no store at all
            assert want.num_cached_tokens == 0 and want.num_output_tokens == wl.answer_tokens

            before1 = fleet.daemon_stats("daemon1")
            asker.ask("engine1", wl.request(0, 0))               # host 1 reads the document
            fleet.wait_remote_writes("daemon1", before1, NUM_CHUNKS + 1)
            # 512 + 24 prompt + 8 answer tokens: 8 full chunks, all of them the document's,
            # and one tail piece (block size 16) of the question, [512, 528)
            assert _redis_keys(redis_cluster) == NUM_CHUNKS + 1

            before2 = fleet.daemon_stats("daemon2")
            assert before2["tiers"]["cpu"]["num_chunks"] == 0
            got = asker.ask("engine2", wl.request(0, 1))         # host 2: same question
            after2 = fleet.daemon_stats("daemon2")
        finally:
            asker.close()
    cpu0, remote0, redis0 = _hits(before2)
    cpu1, remote1, redis1 = _hits(after2)
    assert (cpu1 - cpu0, remote1 - remote0, redis1 - redis0) == (0, NUM_CHUNKS, NUM_CHUNKS)
    assert after2["remote"]["validation_failures"] == 0
    # the document's chunks promoted on the hit, and the piece of host 2's own question
    assert after2["tiers"]["cpu"]["num_chunks"] == NUM_CHUNKS + 1
    assert got.num_cached_tokens == DOC_TOKENS
    assert got.num_output_tokens == want.num_output_tokens == wl.answer_tokens
    assert got.text == want.text
    assert got.token_ids == want.token_ids and len(got.token_ids) == wl.answer_tokens


def test_fleet_quick_json_runs_whole():
    require_redis()
    proc = subprocess.run([sys.executable, "-m", "bench.fleet", "--quick", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    for k in ("recompute_ttft_s", "remote_hit_ttft_s", "local_hit_ttft_s", "remote_get_gbps",
              "redis_raw_get_gbps", "remote_vs_recompute", "remote_vs_local",
              "remote_get_vs_raw"):
        assert res[k] > 0, k
    assert res["outputs_identical"] is True
    assert res["hits_counted_exactly"] is True
    assert res["settings"]["quick"] is True and res["settings"]["num_docs"] == 2
    assert set(res["targets"]) == {"remote_vs_recompute", "remote_vs_local", "remote_get_vs_raw"}
    assert "--remote-url" in res["commands"]["daemon2"]
    assert "remote-hit TTFT" in proc.stderr
