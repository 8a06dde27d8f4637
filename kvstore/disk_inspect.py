"""``kvstore inspect``: a read-only summary of a disk tier, safe next to a running daemon.

lmdb read-only with its reader table (``readonly=True, lock=True``): a read transaction sees
one committed snapshot and the writer in the other process does not reuse the pages it reads
(an lmdb opened with ``lock=False`` next to a live writer can read recycled pages). The disk
path's own lock (``kvstore.tiers.pathlock``) is not taken, so a daemon can start meanwhile.
"""
from __future__ import annotations

import fcntl
import os
from collections import Counter

import lmdb

from kvstore.codec import CorruptChunkError, unpack_header, unpack_value
from kvstore.tiers.disk_space import check_data_file
from kvstore.tiers.pathlock import LOCK_NAME, holder_pid


def inspect_disk(path: str, limit: int = 20, verify: bool = False) -> dict:
    """Summary of a disk tier, safe while a daemon serves it: opens the lmdb read-only with
    lmdb's reader table (``readonly=True, lock=True``: a read transaction sees one committed
    snapshot, and the writer in the other process does not reuse the pages it reads; an lmdb
    opened with ``lock=False`` next to a live writer can read recycled pages) and decodes every
    value's header (``kvstore.codec``). It does not take the disk path's lock
    (``kvstore.tiers.pathlock``), so a daemon can start while it runs. Where lmdb's lock file
    cannot be opened for writing (a read-only copy), it reads without the reader table, holding
    a shared lock on the disk path so no daemon can open it meanwhile, or refuses when one
    holds it.

    Returns:
        ``{"path", "num_chunks", "stored_bytes", "raw_bytes", "num_bad", "held_by_pid" (the pid
        of a live process holding the path, else None), "codecs": {codec: n},
        "layouts": {"dtype [shape]": n}, "namespaces": {ns_id_hex: n}, "chunks": [...]}`` with
        the first ``limit`` chunks (key, parent, dtype, shape, codec, sizes); with ``verify``
        every payload is decoded and checksummed too (``num_bad`` counts failures).

    Args:
        path: the disk tier's directory (``--disk-path``), or its ``data.mdb`` file.
        limit: chunks listed (0: all).
        verify: also decode and checksum every payload.

    Raises:
        ValueError: a negative ``limit``; ``path`` does not exist, is another file, or holds
            no lmdb environment, or one lmdb cannot open (e.g. a store of this process has
            it open: lmdb allows one open per process; read its ``stats()`` instead), naming
            the reason. ``DiskFileTruncated`` (a ``ValueError``): ``data.mdb`` is shorter than
            the pages lmdb's metadata says it uses (reading it would end the process with
            SIGBUS), naming both sizes.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit must be an int >= 0 (0 lists every chunk), got {limit!r}")
    if os.path.basename(os.path.normpath(path)) == "data.mdb" and os.path.isfile(path):
        path = os.path.dirname(os.path.abspath(path))  # the tier's file: read its directory
    elif not os.path.exists(path):
        raise ValueError(f"{path!r} does not exist (give the disk tier's directory, as given "
                         f"to --disk-path)")
    elif os.path.isfile(path):
        raise ValueError(f"{path!r} is a file; pass the disk tier's directory (the one holding "
                         f"data.mdb, as given to --disk-path)")
    if not os.path.exists(os.path.join(path, "data.mdb")):
        raise ValueError(f"{path!r} holds no disk tier (no data.mdb)")
    env, shared = _open_readonly(path)
    try:
        check_data_file(env, path)  # a short data.mdb: SIGBUS on the first read past its end
    except ValueError:
        env.close()
        if shared is not None:
            shared.close()
        raise
    rep: dict = {"path": os.path.abspath(path), "num_chunks": 0, "stored_bytes": 0,
                 "raw_bytes": 0, "num_bad": 0, "held_by_pid": _live_holder(path)}
    codecs, layouts, namespaces, chunks = Counter(), Counter(), Counter(), []
    try:
        with env.begin(buffers=True) as txn:
            for raw_key, value in txn.cursor():
                key = bytes(raw_key)
                try:
                    h = unpack_value(value, key)[0] if verify else unpack_header(value)
                    if h.key != key:
                        raise CorruptChunkError("header key differs from the lmdb key")
                except CorruptChunkError:
                    rep["num_bad"] += 1
                    continue
                rep["num_chunks"] += 1
                rep["stored_bytes"] += len(value)
                rep["raw_bytes"] += h.raw_nbytes
                codecs[h.codec] += 1
                layouts[f"{h.dtype} {list(h.shape)}"] += 1
                namespaces[key[:16].hex()] += 1
                if not limit or len(chunks) < limit:
                    chunks.append({"key": key.hex(), "parent": h.parent.hex() if h.parent else None,
                                   "dtype": h.dtype, "shape": list(h.shape), "codec": h.codec,
                                   "stored_bytes": len(value), "raw_bytes": h.raw_nbytes})
    finally:
        env.close()
        if shared is not None:
            shared.close()
    rep.update(codecs=dict(codecs), layouts=dict(layouts), namespaces=dict(namespaces),
               chunks=chunks)
    return rep


def _open_readonly(path: str):
    """``(env, shared_lock_fd_file)``: the lmdb at ``path`` opened read-only (see
    ``inspect_disk``); the second item is an open file holding a shared ``flock`` on the disk
    path's lock file when lmdb's reader table could not be used, else None.

    Raises:
        ValueError: lmdb cannot open it, naming why (and the holding pid when that is why).
    """
    try:
        return lmdb.open(path, readonly=True, lock=True, subdir=True, readahead=False,
                         max_readers=512), None
    except lmdb.Error as e:
        if "already open in this process" in str(e):
            raise ValueError(f"{path!r} is open in this process already (lmdb allows one open "
                             f"per process): read that store's stats() instead") from None
        first = e
    try:  # no writable lmdb lock file: read without it, but only while no writer can start
        f = open(os.path.join(path, LOCK_NAME), "a+")
    except OSError:
        f = None  # cannot even create the path lock: nobody can open the path for writing
    if f is not None:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise ValueError(f"{path!r} is in use by process {holder_pid(path)} and its lmdb "
                             f"lock file cannot be opened for a safe read ({first})") from None
    try:
        return lmdb.open(path, readonly=True, lock=False, subdir=True, readahead=False), f
    except lmdb.Error as e:
        if f is not None:
            f.close()
        raise ValueError(f"{path!r} is not a readable disk tier: {e}") from None


def _live_holder(path: str) -> int | None:
    """The pid named in the disk path's lock file when that process is alive, else None."""
    pid = holder_pid(path)
    if pid is None:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's
    return pid
