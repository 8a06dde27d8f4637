"""connectors.save_queue.SaveQueue: byte bound, order, errors to the callback, close."""
import threading

import torch

from connectors.save_queue import SaveQueue
from kvstore.keys import Namespace
from kvstore.layout import KVLayout

NS = Namespace("tiny", KVLayout(1, 1, 2, "float16", 2))


def test_bound_drops_when_full_but_takes_an_oversize_item_alone_and_keeps_order():
    gate, got, done = threading.Event(), [], []

    def put(ns, keys, kvs):
        gate.wait(5)
        got.append(keys)
        return len(keys)
    q = SaveQueue(put, capacity_bytes=100, done=lambda *a: done.append(a))
    assert q.try_reserve(250)          # larger than the bound, but the queue is empty
    q.submit(NS, ["a"], [torch.zeros(1)], 250)
    assert not q.try_reserve(1)        # full: the caller drops
    assert q.queued_bytes == 250
    gate.set()
    assert q.wait(5) and q.queued_bytes == 0
    assert q.try_reserve(60) and q.try_reserve(40) and not q.try_reserve(1)
    q.submit(NS, ["b"], [], 60)
    q.submit(NS, ["c", "d"], [], 40)
    assert q.wait(5)
    assert got == [["a"], ["b"], ["c", "d"]]
    assert [(d[0], d[1], d[3]) for d in done] == [(NS, 1, None), (NS, 1, None), (NS, 2, None)]
    q.close()


def test_a_failing_put_goes_to_the_callback_and_the_writer_keeps_going():
    calls, done = [], []

    def put(ns, keys, kvs):
        calls.append(keys)
        if keys == ["bad"]:
            raise OSError("disk full")
        return 1
    q = SaveQueue(put, capacity_bytes=10, done=lambda *a: done.append(a))
    for k in ("bad", "ok"):
        assert q.try_reserve(1)
        q.submit(NS, [k], [], 1)
    assert q.wait(5)
    assert calls == [["bad"], ["ok"]]
    assert done[0][1] is None and isinstance(done[0][3], OSError) and done[1][1:4:2] == (1, None)
    q.close()
    q.close()  # idempotent
    assert not q.try_reserve(1)  # closed: refuses
