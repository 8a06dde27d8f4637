"""The restart pass (``kvstore.republish``) against what a store does meanwhile: a chunk removed
or a namespace cleared while the pass waits for room in the write queue stays out of Redis, a
close ends the pass (or its pause) without a dropped write, a thread left or a logged error,
and a disk chunk is read without holding the store lock. Real Redis; the remote writer is
held on a gate so that each interleaving happens for sure, not by timing."""
import logging
import threading
import time

import kvstore.republish as republish_mod
from kvstore.config import StoreConfig
from kvstore.republish import republish
from kvstore.store import ChunkStore
from tests.kvstore.remote_helpers import CB, NS, count, make_store, prompt, rkey, wait_for
from tests.redis_fixtures import redis_server  # noqa: F401




def _restart_empty(srv, store) -> None:
    srv.kill()
    srv.restart()  # same port, no persistence: empty
    assert wait_for(lambda: store.remote.exists(list(store.stored_keys())[:1]) == [False])


class _Held:
    """Holds the store's remote writer on its next batch until ``release``; records the keys
    the pass reads (``read``, in order)."""

    def __init__(self, store, monkeypatch) -> None:
        self.gate, self.sending = threading.Event(), threading.Event()
        self.read: list = []
        writer = store.remote.writer
        send = writer._write_batch

        def held(batch):
            self.sending.set()
            assert self.gate.wait(20.0)
            send(batch)

        monkeypatch.setattr(writer, "_write_batch", held)
        add_reader = store._st.pins.add_reader  # (once per chunk the pass reads)

        def reading(key):
            if threading.current_thread().name == "kvstore-republish":
                self.read.append(key)
            return add_reader(key)

        monkeypatch.setattr(store._st.pins, "add_reader", reading)

    def release(self) -> None:
        self.gate.set()


def _start_pass(store, reports: list) -> threading.Thread:
    t = threading.Thread(target=lambda: reports.append(republish(store._st, "test")),
                         name="kvstore-republish")
    t.start()
    return t


def test_a_chunk_removed_while_the_pass_waits_for_queue_room_stays_out_of_redis(
        redis_server, monkeypatch):
    a = make_store(redis_server.url, remote_restart_check_s=0, remote_queue_bytes=CB)
    try:
        keys, kvs = prompt(NS, 0, 3)
        assert a.put_chunks(NS, keys, kvs) == 3 and a.flush(5.0)
        _restart_empty(redis_server, a)
        held, reports = _Held(a, monkeypatch), []
        t = _start_pass(a, reports)
        # the first chunk is being sent; the second is read and waits for room in the queue
        assert held.sending.wait(10.0) and wait_for(lambda: len(held.read) == 2)
        victim = held.read[1]
        remover = threading.Thread(target=a.remove, args=(NS, [victim]))
        remover.start()
        assert wait_for(lambda: victim not in a.stored_keys())
        held.release()
        remover.join(10.0)
        t.join(10.0)
        assert not t.is_alive() and a.flush(5.0)
        assert (reports[0].held, reports[0].written) == (3, 2)
        with redis_server.client() as r:
            assert [bool(r.exists(rkey(k))) for k in keys] == [k != victim for k in keys]
    finally:
        a.close()


def test_a_namespace_cleared_during_a_pass_does_not_come_back(redis_server, monkeypatch):
    a = make_store(redis_server.url, remote_restart_check_s=0, remote_queue_bytes=CB)
    try:
        keys, kvs = prompt(NS, 1, 3)
        assert a.put_chunks(NS, keys, kvs) == 3 and a.flush(5.0)
        _restart_empty(redis_server, a)
        held, reports = _Held(a, monkeypatch), []
        t = _start_pass(a, reports)
        assert held.sending.wait(10.0) and wait_for(lambda: len(held.read) == 2)
        # the clear runs while one chunk is on its way to Redis and one waits for room
        clearer = threading.Thread(target=a.clear, args=(NS,))
        clearer.start()
        assert wait_for(lambda: not a.stored_keys())
        held.release()
        clearer.join(10.0)
        t.join(10.0)
        assert not clearer.is_alive() and not t.is_alive() and a.flush(5.0)
        with redis_server.client() as r:
            assert r.dbsize() == 0  # neither the chunk sent nor the one waiting is back
    finally:
        a.close()


def test_a_close_during_the_pause_before_a_pass_ends_it(redis_server, monkeypatch):
    a = make_store(redis_server.url, remote_restart_check_s=30.0)
    monkeypatch.setattr(republish_mod.random, "uniform", lambda lo, hi: hi)  # the longest pause
    rep = a._st.republisher
    rep.schedule("somewhere:1")
    assert rep._thread.is_alive()
    t0 = time.monotonic()
    a.close()
    assert time.monotonic() - t0 < 5.0
    assert not rep._thread.is_alive() and rep.reports == []
    assert not any(t.name == "kvstore-republish" for t in threading.enumerate())
    rep.schedule("somewhere:1")  # a restart noticed after the close starts nothing
    assert not rep._thread.is_alive()


def test_a_close_during_a_pass_counts_no_dropped_write_and_logs_no_error(
        redis_server, monkeypatch, caplog):
    a = make_store(redis_server.url, remote_restart_check_s=0, remote_queue_bytes=CB)
    keys, kvs = prompt(NS, 2, 3)
    assert a.put_chunks(NS, keys, kvs) == 3 and a.flush(5.0)
    _restart_empty(redis_server, a)
    held, writes = _Held(a, monkeypatch), count(a.remote, "writes")
    rep = a._st.republisher
    rep.schedule(f"127.0.0.1:{redis_server.port}")
    assert held.sending.wait(10.0) and wait_for(lambda: len(held.read) == 2)
    with caplog.at_level(logging.INFO):
        closer = threading.Thread(target=a.close)
        closer.start()
        # the pass ends while the close waits for the queue; then the queue drains
        wait_for(lambda: not rep._thread.is_alive(), timeout=3.0)
        held.release()
        closer.join(15.0)
        rep.join(5.0)
    assert not closer.is_alive() and not rep._thread.is_alive()
    assert count(a.remote, "dropped_writes", "closed") == 0
    assert count(a.remote, "writes") == writes + 1  # the chunk already on its way
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_a_disk_chunk_is_read_without_the_store_lock(redis_server, tmp_path):
    cfg = StoreConfig(cpu_bytes=2 * CB, page_bytes=CB, disk_bytes=64 * CB,
                      disk_path=str(tmp_path / "disk"), remote_url=redis_server.url,
                      remote_restart_check_s=0)
    a = ChunkStore(cfg, [NS])
    try:
        keys, kvs = prompt(NS, 3, 6)
        assert a.put_chunks(NS, keys, kvs) == 6 and a.flush(5.0)
        disk = a.tiers[-1]
        on_disk = [k for k in keys if a._st.locate(k) is disk]
        assert len(on_disk) >= 4  # two fit the CPU tier
        _restart_empty(redis_server, a)
        held_lock = []
        read = disk.read

        def reading(key, device="cpu"):
            held_lock.append(a._st.lock._is_owned())
            return read(key, device)

        disk.read = reading
        rep = republish(a._st, "test")
        assert (rep.held, rep.written) == (6, 6)
        assert len(held_lock) == len(on_disk) and not any(held_lock)
        assert a.flush(5.0)
        with redis_server.client() as r:
            assert r.dbsize() == 6
    finally:
        a.close()


def test_a_close_waits_for_the_pass_reading_a_disk_chunk_before_closing_the_tiers(
        redis_server, tmp_path):
    cfg = StoreConfig(cpu_bytes=2 * CB, page_bytes=CB, disk_bytes=64 * CB,
                      disk_path=str(tmp_path / "disk"), remote_url=redis_server.url,
                      remote_restart_check_s=0)
    a = ChunkStore(cfg, [NS])
    keys, kvs = prompt(NS, 4, 6)
    assert a.put_chunks(NS, keys, kvs) == 6 and a.flush(5.0)
    disk = a.tiers[-1]
    _restart_empty(redis_server, a)
    inside, gate, closed_at_read = threading.Event(), threading.Event(), []
    read = disk.read

    def reading(key, device="cpu"):
        inside.set()
        assert gate.wait(20.0)
        closed_at_read.append(disk._closed)
        return read(key, device)

    disk.read = reading
    a._st.republisher.schedule(f"127.0.0.1:{redis_server.port}")
    assert inside.wait(10.0)  # the pass reads a disk chunk (outside the store lock)
    closer = threading.Thread(target=a.close)
    closer.start()
    # the close must not close the disk tier (unmapping what the read uses) under the read
    assert not wait_for(lambda: disk._closed, timeout=1.5)
    gate.set()
    closer.join(15.0)
    assert not closer.is_alive() and disk._closed
    assert closed_at_read and not any(closed_at_read)
    assert not a._st.republisher._thread.is_alive()


def test_a_restart_noticed_while_the_last_pass_ends_gets_its_own_pass(redis_server):
    """The pass's thread takes the restarts queued meanwhile under the lock, then ends; a
    restart noticed between the two (the thread still alive, its loop done) was queued for
    nobody and never got a pass."""
    a = make_store(redis_server.url, remote_restart_check_s=0)
    try:
        keys, kvs = prompt(NS, 5, 2)
        assert a.put_chunks(NS, keys, kvs) == 2 and a.flush(5.0)
        rep = a._st.republisher
        rep.schedule("first:1")
        rep.join(10.0)
        assert len(rep.reports) == 1
        finishing = threading.Event()  # a thread alive, whose loop has ended
        ending = threading.Thread(target=finishing.wait, args=(10.0,))
        ending.start()
        try:
            rep._thread = ending
            rep.schedule(f"127.0.0.1:{redis_server.port}")
            assert wait_for(lambda: len(rep.reports) == 2, timeout=10.0)
        finally:
            finishing.set()
            ending.join()
        assert rep.reports[-1].held == 2
    finally:
        a.close()
