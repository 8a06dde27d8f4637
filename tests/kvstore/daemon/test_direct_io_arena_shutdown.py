"""The daemon's direct I/O at the edges: a CPU arena full of pinned chunks, durable puts, SIGTERM
during uploads through the real CLI (and a restart on the same disk path), and stalled or
vanished uploaders that must evict at most one chunk.
"""
import time

import torch

from kvstore.daemon import protocol as P
from kvstore.keys import Namespace

from tests.kvstore.daemon.direct_io_helpers import (
    CB, KEYS, LAYOUT, NS, TOKEN, chunk, do_get, do_put, make_server, put_body, raw_post,
    read_reply, settled,
)
from tests.kvstore.daemon.direct_io_helpers import _clean, server  # noqa: F401  (fixtures)


# ---- full arenas, durable puts ---------------------------------------------------------------
def test_put_below_an_arena_full_of_pinned_chunks_goes_to_disk_bit_exact(tmp_path):
    srv = make_server(cpu_chunks=2, disk=str(tmp_path / "db"))
    try:
        store = srv.store
        assert do_put(srv, put_body(KEYS[:2], [chunk(0), chunk(1)]))[1]["stored"] == 2
        assert store.pin(NS, KEYS[:2]) == 2
        status, ans = do_put(srv, put_body(KEYS[:5], [chunk(i) for i in range(5)]))
        assert status == 200 and ans["stored"] == 3
        store.flush(10)
        assert all(store.tiers[1].contains(k) for k in KEYS[2:5])
        assert not any(store.tiers[0].contains(k) for k in KEYS[2:5])
        # a get of pinned CPU chunks and disk chunks at once, while the arena stays pinned
        status, got = do_get(srv, KEYS[:5])
        assert status == 200 and all(torch.equal(g, chunk(i)) for i, g in enumerate(got))
        assert store.stats()["rejected_chunks"] == 0
        store.unpin(NS, KEYS[:2])
        settled(srv)
        # a checksum failure in the staged path gives the budget and the pages back too
        e, v = P.entry_for(KEYS[6], chunk(6))
        bad = P.ChunkEntry(e.key, e.nbytes, e.dtype, e.shape, "0" * 16)
        store.pin(NS, store.tiers[0].keys())
        status, ans = do_put(srv, P.put_header(NS, [bad]) + bytes(v))
        assert status == 400 and "checksum" in ans["error"]
        store.unpin(NS, store.tiers[0].keys())
        settled(srv)
        assert store.exists(NS, KEYS[6:7]) == [False]
    finally:
        srv.stop()
        srv.store.close()


def test_durable_put_over_direct_io_commits_to_disk_and_its_cpu_copy_is_exact(tmp_path):
    srv = make_server(disk=str(tmp_path / "db"))
    try:
        status, ans = do_put(srv, put_body(KEYS[:3], [chunk(i) for i in range(3)], durable=True))
        assert status == 200 and ans == {"stored": 3, "num_chunks": 3, "durable": True,
                                         "already_stored": 0, "refused": 0,
                                         "first_refused": None}
        disk = srv.store.tiers[1]
        assert all(disk.contains(k) and not disk.is_pending(k) for k in KEYS[:3])
        # a durable re-put of stored keys: nothing new, still durable, same bytes
        status, ans = do_put(srv, put_body(KEYS[:3], [chunk(i) for i in range(3)], durable=True))
        assert status == 200 and ans["stored"] == 0 and ans["durable"]
        status, got = do_get(srv, KEYS[:3])
        assert all(torch.equal(g, chunk(i)) for i, g in enumerate(got))
        settled(srv)
    finally:
        srv.stop()
        srv.store.close()


# ---- the real CLI: SIGTERM during uploads, restart on the same disk path ----------------------
def _start_cli(tmp_path, *extra):
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.daemon.cli", "serve", "--port", "0",
                             "--cpu-bytes", "1MiB", "--disk-path", str(tmp_path / "db"),
                             "--disk-bytes", "64MiB", "--auth-token", TOKEN, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "listening on" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    host, port = line.strip().rsplit("//", 1)[1].split(":")

    class Srv:
        pass
    srv = Srv()
    srv.host, srv.port, srv.proc = host, int(port), proc
    return srv


def test_sigterm_mid_upload_lets_it_finish_flushes_and_a_restart_serves_it(tmp_path):
    import signal
    srv = _start_cli(tmp_path)
    try:
        kvs = [chunk(300 + i) for i in range(4)]
        body = put_body(KEYS[:4], kvs, durable=True)  # only disk-tier chunks outlive a restart
        cut = len(body) - 3 * CB + 10  # inside the second payload
        s = raw_post(srv, "/v1/put", f"Content-Length: {len(body)}\r\n", body[:cut])
        time.sleep(0.3)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        s.sendall(body[cut:])
        reply = read_reply(s)
        s.close()
        assert reply.startswith(b"HTTP/1.1 200") and b'"stored": 4' in reply, reply[-200:]
        assert srv.proc.wait(20) == 0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
    srv = _start_cli(tmp_path)  # restart on the same disk path: the chunks were flushed
    try:
        status, got = do_get(srv, KEYS[:5])
        assert status == 200 and got[4] is None
        assert all(torch.equal(g, kv) for g, kv in zip(got, kvs))
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(20) == 0


def test_sigterm_with_an_upload_that_never_finishes_exits_after_the_drain_timeout(tmp_path):
    import signal
    srv = _start_cli(tmp_path, "--shutdown-timeout-s", "1")
    try:
        assert do_put(srv, put_body(KEYS[:2], [chunk(0), chunk(1)], durable=True))[0] == 200
        body = put_body(KEYS[2:4], [chunk(2), chunk(3)], durable=True)
        s = raw_post(srv, "/v1/put", f"Content-Length: {len(body)}\r\n", body[:-7])
        time.sleep(0.2)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(20) == 0
        s.close()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
    srv = _start_cli(tmp_path)
    try:
        status, got = do_get(srv, KEYS[:4])
        assert status == 200 and got[2] is None and got[3] is None  # nothing torn
        assert torch.equal(got[0], chunk(0)) and torch.equal(got[1], chunk(1))
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(20) == 0


def test_a_stalled_or_vanished_uploader_evicts_at_most_one_chunk():
    """Reserving every chunk of a put when its header arrived evicted the whole arena for a
    ~1 KB header: a client that then stalled or vanished left an empty cache (no disk tier:
    the 8 evicted chunks were lost). Pages are now reserved as each payload is about to
    arrive."""
    srv = make_server(cpu_chunks=8)
    try:
        kvs = [chunk(i) for i in range(8)]
        assert do_put(srv, put_body(KEYS[:8], kvs))[1]["stored"] == 8
        other = Namespace("tiny-model", LAYOUT, cache_salt="b")
        okeys = other.chunk_keys(list(range(32)))
        parts = [P.entry_for(k, chunk(50 + i)) for i, k in enumerate(okeys)]
        body = P.put_header(other, [e for e, _ in parts]) + bytes(parts[0][1])[:100]
        s = raw_post(srv, "/v1/put", f"Content-Length: {len(body) - 100 + 8 * CB}\r\n", body)
        time.sleep(0.3)
        assert srv.store.tiers[0].num_chunks == 7  # was 0: all 8 evicted for the header
        s.close()
        settled(srv)
        assert sum(srv.store.exists(NS, KEYS[:8])) == 7  # the policy's one victim only
        assert srv.store.exists(other, okeys[:8]) == [False] * 8
        status, got = do_get(srv, KEYS[:8])
        assert sum(g is None for g in got) == 1
        assert all(torch.equal(g, kv) for g, kv in zip(got, kvs) if g is not None)
    finally:
        srv.stop()
        srv.store.close()
