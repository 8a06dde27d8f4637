"""Put staging of the daemon's same-host path: a memory file the *client* owns and writes,
which the daemon maps read-only and copies chunks out of into reserved arena pages.

Why: a put over the socket costs two kernel copies (client -> socket buffer -> daemon) plus
system calls per slice; through a staging area it is one user copy on each side, and the two
overlap (the client fills one half while the daemon copies the other). The arena itself is
never writable by a client.

Contract (``kvstore.daemon.shm_protocol``, op ``stage``):

* The client creates an anonymous memory file (``memfd_create`` with ``MFD_ALLOW_SEALING``)
  of ``nbytes``, seals it against shrinking (``F_SEAL_SHRINK``, then ``F_SEAL_SEAL``) and
  passes its descriptor on the one payload byte of a ``stage`` request (``SCM_RIGHTS``).
* The daemon accepts only a sealed memfd at least ``nbytes`` long and at most its
  ``max_body_bytes``, maps it read-only and closes the descriptor. The shrink seal is what makes
  reading it safe: an unsealed file truncated by the client would make the daemon's next
  read fault (``SIGBUS``) and kill it.
* The client may rewrite the staging bytes at any time: the daemon hashes the bytes it copied
  into the arena (never the staging bytes), so what it stores is what the checksum names, and a
  client racing its own put gets a checksum error, not a corrupt chunk.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import stat
from typing import Any, Callable

import numpy as np
import torch
import xxhash

from kvstore.daemon import protocol as P
from kvstore.daemon.protocol import ProtocolError
from kvstore.direct import ALREADY_STORED, Reservation

#: Bytes hashed per step while copying (the slice is hashed while it is still in cache).
COPY_SLICE = 512 << 10
_SEALS = fcntl.F_SEAL_SHRINK


class ClientStaging:
    """The client's staging memory file: ``nbytes``, sealed against shrinking, mapped
    read-write in this process.

    Attributes:
        fd: the memfd (passed to the daemon by ``stage``; closed by ``close``).
        array: ``np.uint8`` ``[nbytes]`` over the mapping.

    Raises:
        OSError: the system refuses the memfd or the mapping (e.g. no memfd support).
    """

    def __init__(self, nbytes: int):
        if type(nbytes) is not int or nbytes <= 0:
            raise ValueError(f"staging bytes must be a positive int, got {nbytes!r}")
        self.nbytes = nbytes
        self.fd = os.memfd_create("kvstore-put-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            self._mm = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self._mm, dtype=np.uint8)  # [nbytes], writable

    def write(self, offset: int, src: memoryview) -> None:
        """Copy ``src`` (bytes of one chunk) to ``offset``.

        Raises:
            ValueError: the bytes do not fit at ``offset``.
        """
        self._check_fits(offset, src.nbytes)
        np.copyto(self.array[offset:offset + src.nbytes], np.frombuffer(src, dtype=np.uint8))

    def _check_fits(self, offset: int, n: int) -> None:
        if offset < 0 or offset + n > self.nbytes:
            raise ValueError(f"{n} bytes at offset {offset} do not fit a staging area of "
                             f"{self.nbytes}")

    def write_hashed(self, offset: int, src: memoryview) -> str:
        """Copy ``src`` (bytes of one chunk) to ``offset``; returns the xxh3_64 hex of the
        copied bytes (hashed slice by slice while in cache).

        Raises:
            ValueError: the bytes do not fit at ``offset``.
        """
        n = src.nbytes
        self._check_fits(offset, n)
        s = np.frombuffer(src, dtype=np.uint8)
        return copy_hashed(s, [(0, self.array[offset:offset + n])])

    def close(self) -> None:
        """Unmap and close (idempotent; a daemon's mapping stays valid on its side)."""
        if self.fd >= 0:
            self.array = None
            try:
                self._mm.close()
            except BufferError:  # a view is still alive: the mapping goes with it
                pass
            os.close(self.fd)
            self.fd = -1


def copy_hashed(src: np.ndarray, dsts: list[tuple[int, np.ndarray]]) -> str:
    """Copy ``src`` (``np.uint8``) into the destination pieces ``[(offset in src, dst), ...]``
    (together exactly ``src``), hashing what was written to each destination slice by
    slice; returns the xxh3_64 hex of the destination bytes in order."""
    h = xxhash.xxh3_64()
    for base, dst in dsts:
        for o in range(0, dst.size, COPY_SLICE):
            d = dst[o:o + COPY_SLICE]
            np.copyto(d, src[base + o:base + o + d.size])
            h.update(d)
    return h.hexdigest()


def map_client_staging(fd: int, nbytes: int, max_bytes: int) -> np.ndarray:
    """Check a client's staging descriptor (contract in the module docstring) and map it
    read-only: ``np.uint8`` ``[nbytes]``. The caller closes ``fd``.

    Raises:
        ProtocolError: ``nbytes`` not an int in ``[1, max_bytes]``; the descriptor is not a
            regular memory file sealed against shrinking, or is shorter than ``nbytes``.
    """
    if type(nbytes) is not int or not 0 < nbytes <= max_bytes:
        raise ProtocolError(f"stage: nbytes must be an int in [1, {max_bytes}], got "
                            f"{nbytes!r}", 413 if type(nbytes) is int and nbytes > 0 else 400)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolError("stage: the descriptor is not a memory file")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ProtocolError("stage: the descriptor is not a sealable memfd (create it with "
                            "MFD_ALLOW_SEALING)") from None
    if not seals & _SEALS:
        raise ProtocolError("stage: the memfd must be sealed against shrinking "
                            "(F_SEAL_SHRINK)")
    if st.st_size < nbytes:
        raise ProtocolError(f"stage: the memfd holds {st.st_size} bytes, less than the "
                            f"{nbytes} announced")
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    return np.frombuffer(mm, dtype=np.uint8)  # [nbytes], read-only; the mapping lives with it


__all__ = ["ClientStaging", "COPY_SLICE", "copy_hashed", "map_client_staging", "put_direct"]


def put_staged_direct(store, ns, entries, src: np.ndarray):
    """A staged put into the top tier in one call on the store pool: reserve every chunk's
    pages, copy and hash each from ``src``, commit the batch. Returns as ``put_direct``
    (``bad``: the first entry whose bytes do not match its xxh3)."""
    return put_direct(store, ns, entries, lambda items: copy_entries(src, entries, items))


def put_direct(store, ns, entries, fill: Callable[[list], Any]):
    """Reserve every chunk's pages in the top tier, ``fill(items)`` them (it returns None, or
    an entry whose bytes were refused), commit the batch. Returns ``(stored, dropped, None)``,
    ``(0, 0, entry)`` for a refused entry (nothing is committed), or None when a chunk found
    no room in the top tier but a lower tier could take it (nothing is kept; the caller takes
    the general path, which stages it in a buffer). ``fill`` raising keeps nothing either."""
    keys, parents = [e.key for e in entries], P.put_parents(entries)
    items = store.reserve_chunks(ns, keys, parents)
    try:
        if any(it is None for it in items) and store.capabilities.has_lower_tiers:
            store.release_reservations(items)
            return None
        bad = fill(items)
        if bad is not None:
            store.release_reservations(items)
            return 0, 0, bad
    except BaseException:
        store.release_reservations(items)
        raise
    stored = store.commit_chunks(ns, keys, items, parents)
    return stored, sum(it is None for it in items), None


def copy_entries(src: np.ndarray, entries, items) -> Any:
    """Copy each entry's bytes from ``src`` into its reservation or buffer, hashing what
    landed there; the first entry whose hash differs from its ``xxh3``, or None. An entry
    with an empty ``xxh3`` (a version 2 staged put: ``kvstore.daemon.shm_protocol``) is
    copied unhashed."""
    pos = 0
    for e, it in zip(entries, items):
        s, pos = src[pos:pos + e.nbytes], pos + e.nbytes
        if isinstance(it, Reservation):
            dsts, o = [], 0
            for v in it.memoryviews():
                dsts.append((o, np.frombuffer(v, dtype=np.uint8)))
                o += v.nbytes
        elif it is not None and it is not ALREADY_STORED:
            dsts = [(0, it.view(torch.uint8).reshape(-1).numpy())]
        else:
            continue
        if not e.xxh3:
            for base, dst in dsts:
                np.copyto(dst, s[base:base + dst.size])
        elif copy_hashed(s, dsts) != e.xxh3:
            return e
    return None
