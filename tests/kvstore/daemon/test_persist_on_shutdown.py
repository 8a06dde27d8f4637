"""``kvstore serve --disk-path`` writes its memory tier's chunks to the disk tier on SIGTERM
(``--persist-on-shutdown-s``, default 30 s), so a restart on the same path finds them; with 0,
or after a SIGKILL, only what was on disk already survives, and the disk chunks whose parent
lived only in memory are kept as the disk tier's first victims. Real ``kvstore serve`` processes
restarted over one disk tier, chunks put over HTTP (none spills unless the CPU tier is made
small)."""
import signal

import pytest
import torch

from kvstore.config import StoreConfig
from kvstore.daemon import cli
from kvstore.daemon import config as serve_config
from kvstore.store import ChunkStore
from tests.kvstore.daemon.server_helpers import NS, chunk
from tests.kvstore.daemon.test_cli import Daemon, _serve_args

N = 20  # chunks per prompt (256 bytes each)


def keys_of(i: int):
    return NS.chunk_keys([10_000 * (i + 1) + t for t in range(4 * N)])


def kvs_of(i: int):
    return [chunk(100 * i + j) for j in range(N)]


def serve(tmp_path, run: int, *extra: str) -> Daemon:
    return Daemon(tmp_path / f"log{run}", "--cpu-bytes", "1MiB", "--disk-path",
                  str(tmp_path / "disk"), "--disk-bytes", "64MiB", *extra)


def hits(d: Daemon, i: int) -> tuple[int, tuple[str, ...]]:
    with d.client(timeout_s=10) as c:
        r = c.lookup_keys(NS, keys_of(i))
    return r.num_hit_chunks, tuple(set(r.tiers))


def test_sigterm_persists_the_memory_tier_sigkill_and_zero_do_not(tmp_path):
    d = serve(tmp_path, 1)
    try:
        with d.client(timeout_s=10) as c:
            assert c.put_chunks(NS, keys_of(0), kvs_of(0)) == N  # not durable: CPU tier only
            st = c.stats()
            assert (st["tiers"]["cpu"]["num_chunks"], st["tiers"]["disk"]["num_chunks"]) == (N, 0)
    finally:
        assert d.stop() == 0  # SIGTERM
    log = (tmp_path / "log1").read_text()
    assert f"persist on close: wrote {N} chunks" in log and "left out 0" in log, log[-2000:]

    d = serve(tmp_path, 2, "--persist-on-shutdown-s", "0")
    try:
        assert hits(d, 0) == (N, ("disk",))  # found on disk after the restart
        with d.client(timeout_s=10) as c:
            got = c.get_chunks(NS, keys_of(0))
            assert all(torch.equal(g, kv) for g, kv in zip(got, kvs_of(0)))  # bit exact
            assert c.put_chunks(NS, keys_of(1), kvs_of(1)) == N
    finally:
        assert d.stop() == 0  # SIGTERM, persisting disabled
    assert "persist on close" not in (tmp_path / "log2").read_text()

    d = serve(tmp_path, 3)
    try:
        assert hits(d, 0)[0] == N and hits(d, 1) == (0, ())  # 0 s: prompt 1 was not kept
        with d.client(timeout_s=10) as c:
            assert c.put_chunks(NS, keys_of(2), kvs_of(2)) == N
            assert c.stats()["unreachable_bytes"] == 0
    finally:
        assert d.stop(signal.SIGKILL) == -signal.SIGKILL  # a crash writes nothing

    d = serve(tmp_path, 4)
    try:
        assert hits(d, 0)[0] == N and hits(d, 2) == (0, ())
        with d.client(timeout_s=10) as c:
            assert c.stats()["unreachable_bytes"] == 0
    finally:
        assert d.stop() == 0


def test_persist_on_shutdown_setting_flag_env_and_bad_values():
    assert serve_config.resolve({}, {}).persist_on_shutdown_s == 30.0
    args = cli.build_parser().parse_args(["serve", "--persist-on-shutdown-s", "2.5"])
    flags = {k: v for k, v in vars(args).items() if k in serve_config.FIELDS}
    assert serve_config.resolve(flags, {}).persist_on_shutdown_s == 2.5
    env = {"KVSTORE_PERSIST_ON_SHUTDOWN_S": "0"}
    assert serve_config.resolve({}, env).persist_on_shutdown_s == 0.0
    with pytest.raises(ValueError, match="persist_on_shutdown_s must be >= 0 seconds"):
        serve_config.resolve({"persist_on_shutdown_s": -1.0}, {})
    with pytest.raises(serve_config.EnvValueError, match="KVSTORE_PERSIST_ON_SHUTDOWN_S"):
        serve_config.resolve({}, {"KVSTORE_PERSIST_ON_SHUTDOWN_S": "soon"})


def test_after_a_sigkill_disk_chunks_whose_parent_was_in_memory_are_the_first_victims(tmp_path):
    disk = tmp_path / "disk"
    # a 4-chunk CPU tier (64 KiB pages, one 256-byte chunk each)
    d = Daemon(tmp_path / "log1", *_serve_args(disk, "256KiB"))
    a = NS.chunk_keys([50_000 + t for t in range(16)])  # 4 chunks
    b = NS.chunk_keys([60_000 + t for t in range(8)])  # 2 more: a's 2 leaves spill to disk
    root = NS.chunk_keys([70_000 + t for t in range(4)])
    try:
        with d.client(timeout_s=10) as c:
            assert c.put_chunks(NS, a, [chunk(j) for j in range(4)]) == 4
            assert c.put_chunks(NS, b, [chunk(10 + j) for j in range(2)]) == 2
            # written through after the spills: the disk writer commits in order
            assert c.put_chunks(NS, root, [chunk(20)], durable=True) == 1
            assert c.exists(NS, a) == [True] * 4
    finally:
        assert d.stop(signal.SIGKILL) == -signal.SIGKILL  # a's head is lost
    r = ChunkStore(StoreConfig(cpu_bytes=0, disk_bytes=64 * 2**20, disk_path=str(disk)), [NS])
    try:
        t = r.tiers[-1]
        tail = [k for k in a if t.contains(k)]  # (a[1] spills too when the root's put needs room)
        assert len(tail) >= 2 and tail == a[-len(tail):] and t.contains(root[0])
        assert r.stats()["unreachable_bytes"] == sum(t.nbytes_of(k) for k in tail)
        assert set(t.eviction_order()[:len(tail)]) == set(tail)  # kept, first victims
        assert t.next_victim(lambda k: True, leaves_only=True) == a[3]  # deepest first
        assert not t.is_demoted(root[0])
    finally:
        r.close()
