"""The same-host get answered on the event loop (``kvstore.daemon.shm_get.get_now``): chunks in
the shared arena are answered with no hop to the store's thread pool, counted once; a store
lock held elsewhere, a chunk in a lower tier or a host memory tier outside the arena send the
get to the general handler, with the same answer and counts. Tiny layout (``shm_helpers``)."""
from __future__ import annotations

import threading

from kvstore.daemon import shm_ops
from tests.kvstore.daemon.shm_helpers import (KEYS, RawClient, as_bytes, chunk, make_store,
                                              num_pinned, shm_daemon, wait_until)


def count_general_gets(monkeypatch) -> list:
    """Record each get that ``get_now`` left to the general handler."""
    calls, orig = [], shm_ops.HANDLERS["get"]

    async def counted(c, h):
        calls.append(h)
        return await orig(c, h)
    monkeypatch.setitem(shm_ops.HANDLERS, "get", counted)
    return calls


def test_arena_hits_are_answered_inline_and_counted_once(tmp_path, monkeypatch):
    with shm_daemon(tmp_path) as srv:
        calls = count_general_gets(monkeypatch)
        c = RawClient(srv.sock_path)
        c.hello()
        kvs = [chunk(i) for i in range(3)]
        assert c.put(KEYS[:3], kvs)["stored"] == 3
        reply, got = c.get(KEYS[:4])  # 3 in the arena, 1 stored nowhere
        assert got == [as_bytes(kv) for kv in kvs] + [None]
        assert reply["payload_bytes"] == 0 and isinstance(reply["borrow"], int)
        assert num_pinned(srv.store) == 3 and calls == []
        m = srv.store.metrics
        assert m.count("hits", tier="cpu") == 3 and m.count("misses") == 1
        c.send({"op": "release", "borrow": reply["borrow"]})
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        reply, got = c.get(KEYS[4:6])  # nothing found: no borrow, nothing pinned
        assert got == [None, None] and reply["borrow"] is None and calls == []
        assert m.count("misses") == 3 and num_pinned(srv.store) == 0
        c.close()


def test_a_busy_store_lock_sends_the_get_to_the_pool(tmp_path, monkeypatch):
    with shm_daemon(tmp_path) as srv:
        calls = count_general_gets(monkeypatch)
        c = RawClient(srv.sock_path)
        c.hello()
        assert c.put(KEYS[:2], [chunk(1), chunk(2)])["stored"] == 2
        lock, held, done = srv.store._st.lock, threading.Event(), threading.Event()

        def hold() -> None:
            with lock:
                held.set()
                done.wait(0.5)  # the get waits on the pool until the lock is free
        t = threading.Thread(target=hold)
        t.start()
        held.wait(5)
        reply, got = c.get(KEYS[:2])
        t.join()
        assert got == [as_bytes(chunk(1)), as_bytes(chunk(2))] and len(calls) == 1
        assert srv.store.metrics.count("hits", tier="cpu") == 2  # counted once
        c.send({"op": "release", "borrow": reply["borrow"]})
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        c.close()


def test_lower_tiers_and_memory_outside_the_arena_take_the_general_path(tmp_path, monkeypatch):
    # a GPU tier (host memory on a CPU-only machine) is not in the shared arena
    store = make_store(gpu_bytes=4 * 256, disk_bytes=1 << 20, disk_path=str(tmp_path / "d"))
    with shm_daemon(tmp_path, store) as srv:
        calls = count_general_gets(monkeypatch)
        c = RawClient(srv.sock_path)
        c.hello()
        kvs = [chunk(i) for i in range(2)]
        assert c.put(KEYS[:2], kvs)["stored"] == 2
        reply, got = c.get(KEYS[:2])
        assert got == [as_bytes(kv) for kv in kvs] and len(calls) == 1
        if reply.get("borrow") is not None:
            c.send({"op": "release", "borrow": reply["borrow"]})
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        c.close()


def test_a_get_that_falls_back_counts_each_access_once(tmp_path, monkeypatch):
    """A get with a chunk on disk is tried inline (``get_now``), tried again by ``get``, then
    borrowed on the pool: the chunk in the arena is counted one access by the eviction policy
    and the admission filter, as by an in-process get."""
    store = make_store(cpu_bytes=256, disk_bytes=1 << 20, disk_path=str(tmp_path / "d"),
                       promote_on_hit=False, cpu_policy="lfu", admission="tinylfu")
    with shm_daemon(tmp_path, store) as srv:
        calls = count_general_gets(monkeypatch)
        c = RawClient(srv.sock_path)
        c.hello()
        kvs = [chunk(i) for i in range(2)]
        assert c.put(KEYS[:2], kvs)["stored"] == 2  # one of them spilled to disk
        store.flush(10)
        cpu, adm = store.tiers[0], store._st.admission
        (mem,) = [k for k in KEYS[:2] if cpu.contains(k)]
        order = [mem] + [k for k in KEYS[:2] if k != mem]  # the arena chunk first
        before = (cpu.policy.frequency(mem), adm.estimate(mem))
        reply, got = c.get(order)
        assert got == [as_bytes(kvs[KEYS.index(k)]) for k in order] and len(calls) == 1
        assert (cpu.policy.frequency(mem), adm.estimate(mem)) == (before[0] + 1,
                                                                 before[1] + 1)
        c.send({"op": "release", "borrow": reply["borrow"]})
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        c.close()
