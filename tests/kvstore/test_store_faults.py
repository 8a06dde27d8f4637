"""One process per disk path, and an index that never outlives what it indexes.

Two daemons on one disk path each kept their own index of it: after one removed 10 chunks,
the other went on answering lookups with 10 hits while its get returned 1 chunk. Now the
second opener of a disk path is refused (naming the path and the holder's pid), a read-only
``kvstore inspect`` still works next to a running daemon, and any lookup hit that a read then
cannot serve (value missing, corrupt, or another key's) is dropped from the index and counted.
"""
import os
import subprocess
import sys
import time

import pytest
import torch

from kvstore.daemon import cli
from kvstore.daemon.client import KVStoreClient
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.pathlock import LOCK_NAME, DiskPathInUse, holder_pid

LAY = KVLayout(1, 1, 4, "float32", 4)  # 128-byte chunks
NS = Namespace("faults", LAY)
KEYS = NS.chunk_keys(list(range(4 * 10)))


def chunk(i):
    return torch.full(LAY.shape(), float(i)) + torch.arange(32.0).view(LAY.shape()) / 64


def disk_store(path):
    return ChunkStore(StoreConfig(cpu_bytes=0, disk_bytes="1MiB", disk_path=str(path)), [NS])


# ---- one process per disk path ------------------------------------------------------------------
def test_a_second_in_process_store_on_a_disk_path_is_refused_until_the_first_closes(tmp_path):
    a = disk_store(tmp_path)
    assert holder_pid(str(tmp_path)) == os.getpid()
    with pytest.raises(DiskPathInUse) as err:
        disk_store(tmp_path)
    msg = str(err.value)
    assert str(tmp_path) in msg and f"process {os.getpid()}" in msg and "this process" in msg
    assert err.value.pid == os.getpid()
    with pytest.raises(DiskPathInUse):  # a bare tier too
        DiskTier(str(tmp_path), 1 << 20)
    a.put_chunks(NS, KEYS[:2], [chunk(0), chunk(1)])
    a.close()
    assert holder_pid(str(tmp_path)) is None  # released: the lock file is emptied
    b = disk_store(tmp_path)  # and the path opens again, with what a stored
    assert b.lookup_keys(NS, KEYS[:2]).num_hit_chunks == 2
    b.close()


def _serve(path, *extra):
    return subprocess.Popen([sys.executable, "-m", "kvstore.daemon.cli", "serve", "--port", "0",
                             "--cpu-bytes", "1MiB", "--disk-path", str(path),
                             "--disk-bytes", "16MiB", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def daemon(tmp_path):
    proc = _serve(tmp_path / "db")
    line = proc.stdout.readline()
    assert "listening on" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    proc.url = "http://" + line.strip().rsplit("//", 1)[1]
    proc.path = tmp_path / "db"
    yield proc
    proc.terminate()
    assert proc.wait(20) == 0


def test_a_second_kvstore_serve_on_the_same_disk_path_exits_naming_path_and_holder(daemon):
    second = _serve(daemon.path)
    out, err = second.communicate(timeout=60)
    assert second.returncode == 2, (out, err)
    assert "listening" not in out
    assert str(daemon.path) in err and f"in use by process {daemon.pid}" in err, err
    assert LOCK_NAME in err
    with KVStoreClient(daemon.url, timeout_s=5.0) as c:  # the first one is untouched
        assert c.put_chunks(NS, KEYS[:3], [chunk(i) for i in range(3)], durable=True) == 3
        assert c.lookup_keys(NS, KEYS[:3]).num_hit_chunks == 3


def test_inspect_reads_a_disk_path_a_daemon_is_serving(daemon):
    with KVStoreClient(daemon.url, timeout_s=5.0) as c:
        assert c.put_chunks(NS, KEYS[:4], [chunk(i) for i in range(4)], durable=True) == 4
        rep = cli.inspect_disk(str(daemon.path), limit=0, verify=True)
        assert (rep["num_chunks"], rep["num_bad"], rep["held_by_pid"]) == (4, 0, daemon.pid)
        assert [ch["parent"] for ch in rep["chunks"]].count(None) == 1
        assert c.remove(NS, KEYS[:4]) == 4
    # the removal reaches the disk in the background; a later snapshot sees it
    deadline = time.monotonic() + 10
    while cli.inspect_disk(str(daemon.path))["num_chunks"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cli.inspect_disk(str(daemon.path))["num_chunks"] == 0
    # the console command, while the daemon still runs
    done = subprocess.run([sys.executable, "-m", "kvstore.daemon.cli", "inspect", str(daemon.path),
                           "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert '"held_by_pid": %d' % daemon.pid in done.stdout


def test_inspect_of_a_path_this_process_has_open_says_why_not(tmp_path):
    store = disk_store(tmp_path)
    store.put_chunks(NS, KEYS[:1], [chunk(0)])
    store.flush()
    with pytest.raises(ValueError, match="open in this process already"):
        cli.inspect_disk(str(tmp_path))
    store.close()
    assert cli.inspect_disk(str(tmp_path))["num_chunks"] == 1


# ---- stale index entries --------------------------------------------------------------------------
def _behind_the_index(store, fn):
    """Change the lmdb values under the disk tier's index (as another writer would have)."""
    with store.tiers[-1].env.begin(write=True) as txn:
        fn(txn)


@pytest.mark.parametrize("fault", ["missing", "corrupt", "another_key"])
def test_a_lookup_hit_that_a_read_cannot_serve_leaves_the_index(tmp_path, fault):
    store = disk_store(tmp_path)
    kvs = [chunk(i) for i in range(3)]
    assert store.put_chunks(NS, KEYS[:3], kvs) == 3
    store.flush()
    k = bytes(KEYS[1])

    def spoil(txn):
        if fault == "missing":
            txn.delete(k)
        elif fault == "corrupt":
            v = bytearray(txn.get(k))
            v[-5] ^= 0xFF
            txn.put(k, bytes(v))
        else:
            txn.put(k, txn.get(bytes(KEYS[2])))
    _behind_the_index(store, spoil)
    assert store.lookup_keys(NS, KEYS[:3]).num_hit_chunks == 3  # the index still says so
    got = store.get_chunks(NS, KEYS[:3])
    assert torch.equal(got[0], kvs[0]) and got[1] is None and torch.equal(got[2], kvs[2])
    st = store.stats()
    assert st["stale_index_entries"] == 1 and st["stale_index_entries_by_tier"] == {"disk": 1}
    assert st["corruptions"] == (0 if fault == "missing" else 1)
    assert st["misses"] == 1
    assert store.lookup_keys(NS, KEYS[:3]).num_hit_chunks == 1  # the truth from now on
    # chunk 3 lost its parent: no lookup could reach it, so it left with it (as on eviction)
    assert store.exists(NS, KEYS[:3]) == [True, False, False]
    st = store.stats()
    assert st["unreachable_bytes"] == 0 and st["stranded_removals"] == 1
    assert b"kvstore_stale_index_entries_total" in store.metrics.exposition()
    store.check_integrity()
    store.close()
    store = disk_store(tmp_path)  # and after a restart
    assert store.exists(NS, KEYS[:3]) == [True, False, False]
    store.close()


def test_an_engine_connector_on_a_disk_path_in_use_is_a_clear_flag_error(tmp_path):
    from connectors.factory import create_connector
    first = create_connector(disk_path=str(tmp_path), disk_bytes="1MiB")
    with pytest.raises(ValueError, match=f"in use by process {os.getpid()}") as err:
        create_connector(disk_path=str(tmp_path), disk_bytes="1MiB")
    assert str(tmp_path) in str(err.value)
    first.close()
    create_connector(disk_path=str(tmp_path), disk_bytes="1MiB").close()


def test_a_store_that_fails_to_open_releases_its_disk_path(tmp_path):
    big = Namespace("big", KVLayout(64, 8, 128, "float32", 256))  # chunks larger than the tiers
    with pytest.raises(ValueError):
        ChunkStore(StoreConfig(cpu_bytes="1MiB", disk_bytes="1MiB", disk_path=str(tmp_path)),
                   [big])
    assert holder_pid(str(tmp_path)) is None
    disk_store(tmp_path).close()  # the path is free again
