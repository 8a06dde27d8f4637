"""Puts of the same-host client (``kvstore.daemon.shm_client``) on one connection: read by the
daemon from the tensors' memory when ``hello`` established it (``kvstore.daemon.shm_vm``),
else through the connection's staging area when the daemon offers it, else over the socket.

Staged (``kvstore.daemon.shm_staging``): the chunks are split into requests of about
``GROUP_BYTES`` (whole chunks, at least one); request ``g`` is copied into half ``g % 2`` of
the staging area and sent with ``staging_offset`` (its entries without ``xxh3`` when the
daemon speaks protocol version 2, which copies them unhashed; hashed as they are copied for a
version 1 daemon); the client fills
the other half while the daemon copies this one, and reads a reply only before it reuses that
half. Each request commits on its own: a failure leaves the earlier requests' chunks stored
(whole and checked, their parents with them), and a retry finds them stored.

Over the socket: one request whose payload is sent from the tensors' own memory (``sendmsg``,
no join copy); the daemon reads it into reserved arena pages and checks each xxh3.
"""
from __future__ import annotations

import os
from collections import deque
from typing import Any, Sequence

import torch

from kvstore.daemon import protocol as P
from kvstore.daemon import shm_vm
from kvstore.daemon.put_result import PutResult
from kvstore.daemon.shm_protocol import encode_frame
from kvstore.daemon.shm_staging import ClientStaging
from kvstore.errors import RemoteError
from kvstore.keys import ChunkKey, Namespace

#: Bytes of a connection's staging area (two halves; memory of the client, touched as used).
STAGING_BYTES = 64 << 20
#: Chunk bytes per put request from staging (whole chunks, at least one per request).
GROUP_BYTES = 16 << 20
#: Chunk bytes per put request read from the client's memory (whole chunks, at least one).
VM_GROUP_BYTES = 64 << 20


def put_on(conn, deadline: float, ns: Namespace, keys: Sequence[ChunkKey],
           kvs: Sequence[torch.Tensor], parents: Sequence[ChunkKey | None] | None,
           durable: bool, staging_bytes: int = STAGING_BYTES) -> PutResult:
    """Store chunks on ``conn`` (a ``kvstore.daemon.shm_conn.Conn``): staged when the daemon
    offers it (a staging area of ``staging_bytes``, at least two chunks; 0: never), else over
    the socket. Returns how many chunks were newly stored, a ``PutResult`` that also says
    what the daemon did with the rest (``first_refused`` indexed from ``keys[0]``).

    Raises:
        RemoteError: an error reply (after every reply of the requests sent was read).
        TimeoutError, ConnectionError, ProtocolError: as ``Conn.request``.
    """
    views = [P.tensor_bytes(kv) for kv in kvs]
    done: list = []
    if conn.hello.vm_read and not conn.vm_refused and conn.pid == os.getpid():
        done, error = _put_vm(conn, deadline, ns, keys, kvs, views, parents, durable)
        if error is None:
            return PutResult.combine(done)
        if error.status not in (403, 413):  # 403: the kernel refused the read; 413: too big
            raise error
        conn.vm_refused = True  # this connection puts from staging from now on
    staging = _staging(conn, deadline, max(staging_bytes, 2 * views[0].nbytes)) \
        if staging_bytes else None
    if staging is None:
        rest = _put_socket(conn, deadline, ns, keys, kvs, views, parents, durable)
    else:
        rest = _put_staged(conn, deadline, ns, keys, kvs, views, parents, durable, staging)
    return PutResult.combine([*done, rest])


def _put_vm(conn, deadline, ns, keys, kvs, views, parents, durable) -> tuple[list, Any]:
    """Puts whose bytes the daemon reads from ``views``' memory (``kvstore.daemon.shm_vm``):
    requests of about ``VM_GROUP_BYTES`` (whole chunks), all sent, then every reply read.
    Returns ``(a PutResult per request answered, the first RemoteError or None)``; the
    caller's tensors
    stay alive and unchanged meanwhile (this call holds them until every reply is in)."""
    cb = views[0].nbytes
    per = max(1, VM_GROUP_BYTES // cb)
    starts: deque = deque()
    for start in range(0, len(keys), per):
        idx = range(start, min(start + per, len(keys)))
        entries = [_entry(keys[i], kvs[i], cb, "", i, keys, parents, j == 0)
                   for j, i in enumerate(idx)]
        vm = [[shm_vm.address_of(views[i]), cb] for i in idx]
        conn.send([encode_frame(_head(ns, durable, entries, vm=vm, pid=conn.pid))], deadline)
        starts.append(start)
    stored: list = []
    error = None
    while starts:
        error = _take(conn, deadline, starts, stored, error)
    return stored, error


def _staging(conn, deadline: float, nbytes: int) -> ClientStaging | None:
    """The connection's staging area of at least ``nbytes``: made and passed on its first put,
    replaced by a larger one when a put's chunks need it (two chunks at least); None when the
    daemon refuses it (an older daemon, a smaller ``max_body_bytes``) or the system has no
    memfd."""
    if conn.staging_refused:
        return None
    if conn.staging is not None:
        if conn.staging.nbytes >= nbytes:
            return conn.staging
        conn.staging.close()  # the daemon drops its mapping when the next stage replaces it
        conn.staging = None
    try:
        staging = ClientStaging(nbytes)
    except OSError:
        conn.staging_refused = True
        return None
    try:
        conn.send([encode_frame({"op": "stage", "nbytes": nbytes}, 1)], deadline)
        conn.send_fds(b"\0", [staging.fd], deadline)
        conn.reply(deadline)
    except RemoteError:  # e.g. 404 unknown op, 413 too large: put over the socket
        staging.close()
        conn.staging_refused = True
        return None
    except BaseException:
        staging.close()
        raise
    conn.staging = staging
    return staging


def _entry(key: ChunkKey, kv: torch.Tensor, nbytes: int, xxh3: str, i: int,
           keys: Sequence[ChunkKey], parents, first: bool) -> P.ChunkEntry:
    """Header entry of chunk ``i``; its parent is written when it is not the previous
    entry's key of the same request (``first``: the request's first entry)."""
    e = P.ChunkEntry(key, nbytes, P.dtype_name(kv.dtype), tuple(kv.shape), xxh3)
    if parents is not None:
        if i == 0 or first or parents[i] != keys[i - 1]:
            return P.ChunkEntry(key, nbytes, e.dtype, e.shape, xxh3, parent=parents[i],
                                parent_given=True)
    elif first and i:
        return P.ChunkEntry(key, nbytes, e.dtype, e.shape, xxh3, parent=keys[i - 1],
                            parent_given=True)
    return e


def _head(ns: Namespace, durable: bool, entries: list, **extra) -> dict:
    """A put header; entries with an empty ``xxh3`` are sent without one (staged, v2)."""
    return {"op": "put", "namespace": ns.to_dict(), "durable": durable,
            "chunks": [_entry_dict(e) for e in entries], **extra}


def _entry_dict(e: P.ChunkEntry) -> dict:
    d = e.to_dict()
    if not e.xxh3:
        del d["xxh3"]
    return d


def _put_socket(conn, deadline, ns, keys, kvs, views, parents, durable) -> PutResult:
    entries = [_entry(k, kv, v.nbytes, P.checksum(v), i, keys, parents, False)
               for i, (k, kv, v) in enumerate(zip(keys, kvs, views))]
    head = encode_frame(_head(ns, durable, entries), sum(v.nbytes for v in views))
    return PutResult.from_answer(conn.request(head, deadline, views))


def _put_staged(conn, deadline, ns, keys, kvs, views, parents, durable,
                staging: ClientStaging) -> PutResult:
    cb = views[0].nbytes
    half = staging.nbytes // 2
    per = max(1, min(GROUP_BYTES, half) // cb)
    pending: deque = deque()  # the first chunk index of each request sent, not answered
    stored: list = []
    error = None
    hashed = conn.hello.version < 2  # version 2: staged entries go unhashed
    for g, start in enumerate(range(0, len(keys), per)):
        if len(pending) == 2:
            error = _take(conn, deadline, pending, stored, error)
            if error is not None:
                break
        base = (g % 2) * half
        entries = []
        for j, i in enumerate(range(start, min(start + per, len(keys)))):
            if hashed:
                xxh3 = staging.write_hashed(base + j * cb, views[i])
            else:
                staging.write(base + j * cb, views[i])
                xxh3 = ""
            entries.append(_entry(keys[i], kvs[i], cb, xxh3, i, keys, parents, j == 0))
        conn.send([encode_frame(_head(ns, durable, entries, staging_offset=base))], deadline)
        pending.append(start)
    while pending:
        error = _take(conn, deadline, pending, stored, error)
    if error is not None:
        raise error
    return PutResult.combine(stored)


def _take(conn, deadline, pending: deque, stored: list, error):
    """Read the oldest pending reply (``pending``: the first chunk index of each request
    not answered), appending its ``PutResult`` to ``stored``; returns the first error."""
    start = pending.popleft()
    try:
        stored.append(PutResult.from_answer(conn.reply(deadline), start))
    except RemoteError as e:
        error = error or e
    return error


__all__ = ["GROUP_BYTES", "STAGING_BYTES", "VM_GROUP_BYTES", "put_on"]
