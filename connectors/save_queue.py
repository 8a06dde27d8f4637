"""Bounded background writer of a KV connector's saves.

Saving must never stall the engine: the engine thread gathers a request's chunks out of its KV
pool, ``try_reserve``s their bytes and ``submit``s them; one writer thread calls the store's
``put_chunks`` in arrival order. The queue holds at most ``capacity_bytes`` of gathered chunks
(an item larger than that is still taken when the queue is empty, so a big save never starves);
when it is full the caller drops the save (a lost future hit, never a wait).

The writer thread runs at a lower CPU priority (``WRITER_NICE`` above the process's, Linux:
per thread): on a host whose cores the engine's compute threads fill, a put (a copy into the
store, or a send to the daemon) takes the cycles they leave instead of stalling the forward
pass that produces the next first token. While the engine thread waits on the store lock
the writer holds, the compute threads are idle, so the writer still runs.

A save may carry a follow-up (``submit(then=...)``) run on the writer thread right after its
put succeeded: the connectors demote the tail pieces a saved full chunk covers there
(``demote_superseded``), off the engine's critical path.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Callable, Sequence

import torch

from kvstore.keys import ChunkKey, Namespace

log = logging.getLogger("connectors.save_queue")

#: ``done(ns, stored, seconds, error)``: called on the writer thread after each put; ``stored``
#: is the number of chunks newly stored (None when ``error`` is set).
DoneCallback = Callable[[Namespace, "int | None", float, "Exception | None"], None]

#: How much nicer (lower CPU priority) than its process the writer thread runs.
WRITER_NICE = 10


def lower_thread_priority(nice: int) -> bool:
    """Make the calling thread ``nice`` steps nicer (Linux: ``setpriority`` on its thread
    id). False where the platform does not allow it (nothing changed)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        return True
    except (AttributeError, OSError):
        return False


class SaveQueue:
    """Background ``put(ns, keys, kvs)`` calls with a byte bound. Thread-safe.

    Args:
        put: the store's ``put_chunks(ns, keys, kvs) -> int``.
        capacity_bytes: most bytes of gathered chunks waiting or being written.
        done: see ``DoneCallback``; exceptions raised by ``put`` go to it, never up.
        name: the writer thread's name.
    """

    def __init__(self, put: Callable[[Namespace, Sequence[ChunkKey], Sequence[torch.Tensor]], int],
                 capacity_bytes: int, done: DoneCallback, name: str = "kvconn-writer") -> None:
        self.capacity_bytes = capacity_bytes
        self._put, self._done = put, done
        self._q: queue.Queue = queue.Queue()
        self._bytes = 0
        self._items = 0
        self._cv = threading.Condition()
        self._closed = False
        self._writer = threading.Thread(target=self._loop, name=name, daemon=True)
        self._writer.start()

    @property
    def queued_bytes(self) -> int:
        """Bytes reserved by items not written yet."""
        return self._bytes

    def try_reserve(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` for one item about to be ``submit``ted. False (nothing reserved)
        when the queue is full or closed: the caller drops the save."""
        with self._cv:
            if self._closed or (self._items > 0 and self._bytes + nbytes > self.capacity_bytes):
                return False
            self._bytes += nbytes
            self._items += 1
            return True

    def submit(self, ns: Namespace, keys: Sequence[ChunkKey], kvs: Sequence[torch.Tensor],
               nbytes: int, parents: Sequence[ChunkKey | None] | None = None,
               then: Callable[[int], None] | None = None) -> None:
        """Queue one reserved item (``nbytes`` as passed to ``try_reserve``); ``kvs`` are the
        gathered chunks ``[num_layers, 2, chunk_size, num_kv_heads, head_dim]``, owned by the
        queue from now on; ``parents`` as ``KVStoreBase.put_chunks`` takes them (passed on
        only when not None). ``then(stored)``: called on the writer thread after the put
        returned (not when it raised), before ``done``; an exception it raises is logged,
        never raised."""
        self._q.put((ns, keys, kvs, nbytes, parents, then))

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted item is written. False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._items == 0, timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait up to ``timeout_s`` for queued items, refuse new ones, stop the writer.
        Idempotent."""
        if self._closed:
            return
        self.wait(timeout_s)
        with self._cv:
            self._closed = True
        self._q.put(None)
        self._writer.join(10)

    def _loop(self) -> None:
        lower_thread_priority(WRITER_NICE)
        while True:
            item = self._q.get()
            if item is None:
                return
            ns, keys, kvs, nbytes, parents, then = item
            del item
            t0 = time.perf_counter()
            try:
                args = (ns, keys, kvs) if parents is None else (ns, keys, kvs, parents)
                stored, error = self._put(*args), None
            except Exception as exc:  # noqa: BLE001 - a failed save only costs a future hit
                stored, error = None, exc
            del kvs
            if then is not None and error is None:
                try:
                    then(stored)
                except Exception:  # noqa: BLE001 - a follow-up never stops the writer
                    log.exception("save follow-up failed")
            try:
                self._done(ns, stored, time.perf_counter() - t0, error)
            finally:
                with self._cv:
                    self._bytes -= nbytes
                    self._items -= 1
                    self._cv.notify_all()


def _direct(fn: Callable, *args):
    return fn(*args)


def known_present(keys: Sequence[ChunkKey], stored: int) -> list[bool] | None:
    """Which of a put's ``keys`` the store holds just after it, as the put's answer says
    (``kvstore.daemon.put_result.PutResult``), or None when it does not say.

    Every key when all were newly stored, or when the answer refused none (``refused == 0``:
    the rest were stored before); when every key from the first refused one on was refused
    (``refused == len(keys) - first_refused["index"]``, as a batch that stops at its first
    refusal answers; all of them when that index is 0), those before it only. None for a
    plain count (an in-process store, an older daemon: ``refused`` None) or any other
    answer: ``store.exists`` must tell.
    """
    n = len(keys)
    if stored >= n:
        return [True] * n
    refused = getattr(stored, "refused", None)
    if refused is None or getattr(stored, "num_chunks", None) != n:
        return None
    if refused == 0:
        return [True] * n
    first = getattr(stored, "first_refused", None)
    if first is not None and refused == n - first["index"]:
        return [i < first["index"] for i in range(n)]
    return None


def demote_superseded(store, ns: Namespace, keys: Sequence[ChunkKey], stored: int, sup,
                      call: Callable = _direct) -> int:
    """After a put of the full chunks ``keys`` of ``ns`` (``stored`` of them newly stored,
    the put's ``PutResult`` or a plain count), demote the tail pieces ``sup`` (a
    ``connectors.chunk_records.Superseded``) whose covering chunk is stored: as the put's
    answer says when it does (``known_present``: no store call when every chunk is stored,
    now or before, nor when every chunk from the first refused one on was refused), else
    those whose chunk ``store.exists`` finds (a chunk the store rejected leaves its pieces as
    they were).

    Args:
        store: any ``KVStoreBase``.
        call: ``call(fn, *args)`` makes each store call (e.g. the vLLM connector's
            ``StoreCalls``, which adds the daemon's deadline); default: ``fn(*args)``.

    Returns the number of pieces the store demoted (``KVStoreBase.demote``); 0 without a
    call when no covering chunk is stored.

    Raises:
        whatever the store calls raise (the caller counts and logs it).
    """
    pieces = list(sup.keys)
    present = known_present(keys, stored)
    if present is None:
        need = sorted(set(sup.chunk_index))
        found = dict(zip(need, call(store.exists, ns, [keys[i] for i in need])))
        pieces = [k for k, c in zip(sup.keys, sup.chunk_index) if found[c]]
    elif not all(present):
        pieces = [k for k, c in zip(sup.keys, sup.chunk_index) if present[c]]
    return call(store.demote, sup.ns, pieces) if pieces else 0
