"""The disk tier against damaged files and full filesystems (real lmdb, real tmpfs mounts):
a truncated ``data.mdb`` is refused at open instead of a SIGBUS, a restart with a smaller
capacity refuses to evict unless allowed, and a full filesystem lowers the tier's capacity,
evicts instead of failing, logs its cause and the capacity change in one line per interval,
keeps the tier's counts equal to what lmdb holds, and the capacity comes back toward the
configured one when the space does."""
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from kvstore.config import StoreConfig
from kvstore.daemon.config import ServeConfig
from kvstore.disk_inspect import inspect_disk
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_space import DiskShrinkRefused, RateLimitedLog, filesystem_cap
from tests.kvstore.tmpfs_helpers import mounted_tmpfs

LAY = KVLayout(4, 4, 64, "float32", 64)  # 512 KiB chunks, incompressible (random)
NS = Namespace("disk-files", LAY)
KEYS = NS.chunk_keys(list(range(64 * 64)))


def chunk(i: int) -> torch.Tensor:
    return torch.randn(LAY.shape(), generator=torch.Generator().manual_seed(i))


def run(*args, timeout=120):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=os.path.dirname(os.path.dirname(
                              os.path.dirname(os.path.abspath(__file__)))))


def filled(path: str, n: int) -> None:
    t = DiskTier(path, 2**30, codec="raw")
    for i in range(n):
        t.put(KEYS[i], chunk(i), None)
    assert t.flush(60)
    t.close()


# ---- a truncated data.mdb ------------------------------------------------------------------
def test_a_truncated_data_file_is_refused_with_both_sizes_not_a_sigbus(tmp_path):
    path = str(tmp_path / "kv")
    filled(path, 8)
    data = os.path.join(path, "data.mdb")
    full = os.path.getsize(data)
    with open(data, "rb") as f:
        intact = f.read()
    os.truncate(data, full // 2)
    # (in subprocesses: before the check, each of these died of SIGBUS)
    opened = run("-c", f"from kvstore.tiers.disk import DiskTier; DiskTier({path!r}, 2**30)")
    assert opened.returncode == 1 and "DiskFileTruncated" in opened.stderr, opened.stderr[-2000:]
    insp = run("-m", "kvstore", "inspect", path, "--verify")
    serve = run("-m", "kvstore", "serve", "--port", "0", "--cpu-bytes", "4MiB",
                "--disk-path", path)
    for p, cmd in ((insp, "inspect"), (serve, "serve")):
        assert p.returncode == 2, (cmd, p.returncode, p.stderr[-2000:])
        line = [ln for ln in p.stderr.splitlines() if "truncated" in ln]
        assert len(line) == 1 and line[0].startswith(f"kvstore {cmd}: {data} is {full // 2} "
                                                     f"bytes"), p.stderr[-2000:]
        assert f"uses {full} bytes" in line[0] and "Traceback" not in p.stderr
    with pytest.raises(ValueError, match=f"is {full // 2} bytes"):
        inspect_disk(path)
    with open(data, "wb") as f:  # the file restored: it opens with every chunk
        f.write(intact)
    t = DiskTier(path, 2**30)
    assert t.num_chunks == 8 and torch.equal(t.read(KEYS[7]), chunk(7))
    t.close()


# ---- a smaller capacity at restart ---------------------------------------------------------
def test_a_smaller_capacity_at_restart_refuses_unless_shrinking_is_allowed(tmp_path):
    path = str(tmp_path / "kv")
    filled(path, 6)
    held = inspect_disk(path)["stored_bytes"]
    with pytest.raises(DiskShrinkRefused) as e:
        ChunkStore(StoreConfig(cpu_bytes=0, disk_path=path, disk_bytes="1MiB"))
    msg = str(e.value)
    assert f"holds {held} bytes" in msg and f"capacity of {2**20} bytes" in msg
    assert "--disk-shrink" in msg and "allow_disk_shrink" in msg
    assert inspect_disk(path)["num_chunks"] == 6  # nothing was evicted
    # the daemon: exit 2 with that one line; --disk-shrink evicts and starts
    p = run("-m", "kvstore", "serve", "--port", "0", "--cpu-bytes", "4MiB", "--disk-path", path,
            "--disk-bytes", "1MiB")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert [ln for ln in p.stderr.splitlines() if ln.startswith("kvstore serve: disk tier")]
    assert inspect_disk(path)["num_chunks"] == 6
    assert ServeConfig(disk_path=path, disk_shrink=True).store_config_kwargs()[
        "allow_disk_shrink"] is True
    store = ChunkStore(StoreConfig(cpu_bytes=0, disk_path=path, disk_bytes="1MiB",
                                   allow_disk_shrink=True))
    try:
        assert 0 < sum(store.exists(NS, KEYS[:6])) <= 2
    finally:
        store.close()
    with pytest.raises(ValueError, match="allow_disk_shrink must be a bool"):
        StoreConfig(cpu_bytes=0, disk_path=path, disk_bytes="1MiB", allow_disk_shrink="yes")


# ---- a full filesystem ---------------------------------------------------------------------
def test_a_repeated_error_is_logged_once_per_interval_with_a_count(caplog):
    now = [0.0]
    rl = RateLimitedLog(logging.getLogger("kvstore.test"), 10.0, clock=lambda: now[0])
    with caplog.at_level(logging.ERROR, "kvstore.test"):
        logged = [rl.log(logging.ERROR, "failed %d", i) for i in range(5)]
        now[0] = 10.5
        logged.append(rl.log(logging.ERROR, "failed %d", 5))
    assert logged == [True, False, False, False, False, True]
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["failed 0", "failed 5 (4 more like it since the previous line, not logged)"]


@pytest.fixture
def tmpfs_20m(tmp_path):
    """A 20 MiB tmpfs (skips where this process may not mount one)."""
    with mounted_tmpfs(tmp_path, "20m") as where:
        yield where


def test_a_full_filesystem_evicts_names_its_cause_and_counts_what_lmdb_holds(tmpfs_20m, caplog):
    path = str(tmpfs_20m / "kv")
    store = ChunkStore(StoreConfig(cpu_bytes=4 * LAY.chunk_bytes, disk_path=path,
                                   disk_bytes="4GiB", disk_codec="raw"))
    try:
        disk = store.tiers[-1]
        assert disk.capacity_bytes <= 20 * 2**20  # lowered to the filesystem at open
        with caplog.at_level(logging.INFO, "kvstore.tiers.disk"):
            for i in range(60):  # 30 MiB into 20 MiB
                assert store.put_chunks(NS, KEYS[i:i + 1], [chunk(i)]) == 1
                store.flush(30)
        st = store.stats()["tiers"]["disk"]
        assert st["capacity_bytes"] <= 20 * 2**20 and st["used_bytes"] <= st["capacity_bytes"]
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not any("writing a batch" in m for m in errors), errors[:3]
        assert all("filesystem full:" in m and f"bytes free on {path}" in m for m in errors)
        assert len(errors) <= 6  # at most one line per 10 s
        # the newest chunks are stored and read back bit exact; the oldest were evicted
        on_disk = [i for i in range(60) if disk.contains(KEYS[i])]
        assert len(on_disk) >= 8 and 59 - 4 in on_disk
        got = store.get_chunks(NS, [KEYS[i] for i in on_disk])
        assert all(torch.equal(g, chunk(i)) for g, i in zip(got, on_disk))
        # deletes on the full filesystem: the tier counts exactly what lmdb still holds
        fd = os.open(str(tmpfs_20m / "filler"), os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 65536)
        except OSError:
            pass
        finally:
            os.close(fd)
        store.remove(NS, [KEYS[i] for i in on_disk[:4]])
        store.flush(30)
        num, used = disk.num_chunks, disk.used_bytes
        store.check_integrity()
    finally:
        store.close(persist_s=0)
    rep = inspect_disk(path)
    assert (rep["num_chunks"], rep["stored_bytes"]) == (num, used)


def test_a_delete_lmdb_could_not_commit_stays_counted_and_is_retried(tmp_path, monkeypatch,
                                                                   caplog):
    path = str(tmp_path / "kv")
    t = DiskTier(path, 2**30, codec="raw")
    try:
        for i in range(4):
            t.put(KEYS[i], chunk(i), None)
        assert t.flush(30)
        used = t.used_bytes
        # (a delete alone in its batch: committed one by one, and each commit fails)
        monkeypatch.setattr(DiskTier, "_write_batch", lambda self, b: self._one_by_one(b, {}))
        monkeypatch.setattr(DiskTier, "_delete_now", lambda self, key: False)
        assert t.delete(KEYS[0]) and not t.contains(KEYS[0])
        assert t.flush(30)
        assert (t.num_chunks, t.used_bytes) == (4, used)  # lmdb still holds it
        monkeypatch.undo()
        t.put(KEYS[4], chunk(4), None)  # the next write retries the delete
        assert t.flush(30)
        assert t.num_chunks == 4 and not t._doomed
        t.check_integrity()
        # one still failing at close: tried once more there, then logged
        monkeypatch.setattr(DiskTier, "_write_batch", lambda self, b: self._one_by_one(b, {}))
        monkeypatch.setattr(DiskTier, "_delete_now", lambda self, key: False)
        assert t.delete(KEYS[1]) and t.flush(30) and t.num_chunks == 4
        with caplog.at_level(logging.WARNING, "kvstore.tiers.disk"):
            t.close()
        assert any("1 deleted chunks could not be removed" in r.getMessage()
                   for r in caplog.records)
    finally:
        t.close()
    assert inspect_disk(path)["num_chunks"] == 4  # KEYS[1] is still there


def _fill(path) -> None:
    """Write zeros to ``path`` until its filesystem is full."""
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        pass
    finally:
        os.close(fd)


@pytest.mark.parametrize("disk_bytes", [12 * 2**20, 2**32], ids=["12MiB", "4GiB"])
def test_a_full_filesystem_is_one_line_and_the_capacity_comes_back_with_the_space(
        tmpfs_20m, caplog, disk_bytes):
    path = str(tmpfs_20m / "kv")
    store = ChunkStore(StoreConfig(cpu_bytes=4 * LAY.chunk_bytes, disk_path=path,
                                   disk_bytes=disk_bytes, disk_codec="raw"))
    disk = store.tiers[-1]
    step = disk.footprint(LAY.chunk_bytes)

    def put(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            assert store.put_chunks(NS, KEYS[i:i + 1], [chunk(i)]) == 1
            assert store.flush(30)
            assert disk.used_bytes <= disk.capacity_bytes <= disk.configured_capacity_bytes

    def evictions() -> int:
        return store.stats()["evictions_by_tier"].get("disk", 0)

    try:
        assert disk.configured_capacity_bytes == disk_bytes
        opened = disk.capacity_bytes            # 4 GiB: lowered to the filesystem at open
        assert opened == min(disk_bytes, opened) and opened <= 20 * 2**20
        put(0, 12)                              # 6 MiB
        _fill(tmpfs_20m / "filler")
        caplog.clear()
        with caplog.at_level(logging.INFO, "kvstore.tiers.disk"):
            put(12, 20)                         # full: evicts, lowers the capacity
            lowered = disk.capacity_bytes
            assert lowered < 7 * 2**20 and evictions() > 0
            loud = [r for r in caplog.records if r.levelno >= logging.INFO]
            assert len(loud) == 1, [r.getMessage() for r in loud]   # one line for the event
            assert loud[0].levelno == logging.ERROR and loud[0].getMessage().startswith(
                f"disk tier {path}: filesystem full: ") and f"; capacity lowered from " \
                f"{opened} to " in loud[0].getMessage()
            caplog.clear()

            os.remove(tmpfs_20m / "filler")     # the space comes back
            disk._capacity_checked = time.monotonic()   # checked just now
            put(20, 22)                         # within 10 s of a check: not looked at
            assert disk.capacity_bytes == lowered and not caplog.records
            disk._capacity_checked -= disk.capacity_check_s            # 10 s later
            put(22, 23)
            raised = disk.capacity_bytes
            if disk_bytes < 2**30:              # the configured capacity, not more
                assert raised == disk_bytes
            else:                               # what the filesystem holds, not the 4 GiB
                assert lowered + 8 * step < raised <= 0.9 * 20 * 2**20
                assert raised <= filesystem_cap(path) + step
            info = [r.getMessage() for r in caplog.records]
            assert info == [f"disk tier {path}: its filesystem has room again ("
                            f"{info[0].split('(')[1].split(')')[0]}): capacity raised from "
                            f"{lowered} to {raised} bytes (configured: {disk_bytes})"], info
            # the raised room is used: chunks are stored past the lowered capacity without
            # evicting, then evicted by policy at the new capacity, the filesystem never full
            before, room = evictions(), (raised - disk.used_bytes) // step
            put(23, 23 + room)
            assert evictions() == before and disk.used_bytes > lowered
            put(23 + room, 23 + room + 6)
            assert evictions() > before and disk.capacity_bytes == raised
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        num, used = disk.num_chunks, disk.used_bytes
        store.check_integrity()
    finally:
        store.close(persist_s=0)
    rep = inspect_disk(path)
    assert (rep["num_chunks"], rep["stored_bytes"]) == (num, used)
