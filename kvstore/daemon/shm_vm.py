"""Puts read straight from the client's memory (protocol version 3 of the same-host path):
the daemon copies a chunk from the client's tensor into reserved arena pages with
``process_vm_readv`` (Linux cross-memory attach, as MPI libraries use for large messages
within a node), so a put costs one copy instead of two (client -> staging area -> arena).
The kernel pins and copies the client's pages 4 KiB at a time, which holds one thread to
4-7 GB/s where memcpy runs 8-10 GB/s here, so a read of 8 MiB or more is cut into parts read
on up to ``READ_WAYS`` threads at once (``vm_read_parallel``).

Contract (``kvstore.daemon.shm_protocol``):

* ``hello`` may carry ``vm_probe: {"address": int, "hex": str}``: the address of up to 64
  bytes of the client's memory and their hex. The daemon reads them from the connection's
  peer (the pid ``SO_PEERCRED`` gave at connect) and answers ``vm_read: true`` only when it
  read exactly those bytes. The kernel decides whether the daemon may read the client
  (ptrace access: the same user without Yama restrictions, or root; under Yama
  ``ptrace_scope`` 1 the client names the daemon its ptracer, ``allow_daemon_to_read``).
* A put of such a connection may give, instead of a payload or ``staging_offset``,
  ``vm: [[address, nbytes], ...]``: one range per chunk entry, ``nbytes`` equal to the entry's,
  and ``pid``: the sender's pid, which must be the pid that connected (403 otherwise: a child
  forked after connecting names addresses of its own memory, not of the process read).
  Entries may leave out ``xxh3`` (no byte crosses a socket, as from staging). The daemon
  reads only from the connection's peer and only the ranges named, reserves the pages, copies,
  checks that the peer is still the same process (its pidfd has not signalled an exit: a pid
  reused mid-read would name another process) and still holds the connection open, and
  commits; a read that fails or falls short stores nothing and is answered 400 (a bad range),
  403 (the kernel refused the read; the client then puts from staging for the rest of the
  connection) or 410 (the client exited or closed the connection meanwhile).
* The client must not change or free those bytes before the put's reply (the call blocks); a
  call that gives up (a timeout) closes the connection first, so a read that ends after that
  is dropped, not committed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import torch

from kvstore.daemon.protocol import ProtocolError
from kvstore.daemon.shm_staging import put_direct
from kvstore.direct import Reservation

#: Most iovecs one ``process_vm_readv`` call takes (``IOV_MAX`` on Linux).
IOV_MAX = 1024
#: Threads one large put's read is cut across (``vm_read_parallel``): the CPUs this process
#: may run on, at most 4.
READ_WAYS = max(1, min(4, len(os.sched_getaffinity(0))))
#: Smallest part of a cut read, in bytes (smaller reads are not worth a thread hand-off).
PARALLEL_MIN_PART_BYTES = 4 << 20
#: Bytes of a ``vm_probe`` at most.
PROBE_MAX_BYTES = 64
_PR_SET_PTRACER = 0x59616D61
_YAMA = "/proc/sys/kernel/yama/ptrace_scope"


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = lib.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                   ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return lib


_LIBC = _libc()


def available() -> bool:
    """Whether this system has ``process_vm_readv`` (Linux 3.2+, glibc 2.15+)."""
    return _LIBC is not None and hasattr(os, "pidfd_open")


def _iovecs(ranges: Sequence[tuple[int, int]]):
    arr = (_IOVec * len(ranges))()
    for i, (a, n) in enumerate(ranges):
        arr[i].base, arr[i].len = a, n
    return arr


def vm_read(pid: int, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]) -> int:
    """Copy ``remote`` ranges ``(address, nbytes)`` of process ``pid`` into ``local`` ranges of
    this process, in order (both lists describe the same total bytes); returns bytes copied
    (less than the total when a remote range ends in unmapped memory). Releases the GIL.

    Raises:
        OSError: the kernel's error (EPERM: no ptrace access to ``pid``; ESRCH: no such
            process; EFAULT: the first remote range is not readable).
    """
    done = 0
    li, ri = list(local), list(remote)
    while li and ri:
        lb, rb = li[:IOV_MAX], ri[:IOV_MAX]
        want = min(sum(n for _, n in lb), sum(n for _, n in rb))
        got = _LIBC.process_vm_readv(pid, _iovecs(lb), len(lb), _iovecs(rb), len(rb), 0)
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        done += got
        if got < want:
            return done
        li, ri = _advance(li, want), _advance(ri, want)
    return done


def _split(ranges: list[tuple[int, int]], nbytes: int):
    """``ranges`` cut after their first ``nbytes`` bytes: ``(head, tail)``."""
    head, left = [], nbytes
    for i, (a, n) in enumerate(ranges):
        if n >= left:
            head.append((a, left))
            tail = ([(a + left, n - left)] if n > left else []) + list(ranges[i + 1:])
            return head, tail
        head.append((a, n))
        left -= n
    return head, []


def vm_read_parallel(pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]],
                     ways: int) -> int:
    """``vm_read`` of the same ranges cut into ``ways`` parts of about equal bytes, read on
    as many threads at once (the calling thread reads the first part): the kernel pins and
    copies 4 KiB pages one by one, so one thread reads at 4-7 GB/s where two cores copy
    more. Returns the bytes copied (less than the total when a part fell short); raises the
    first part's ``OSError``."""
    total = sum(n for _, n in local)
    if ways <= 1 or total < 2 * PARALLEL_MIN_PART_BYTES:
        return vm_read(pid, local, remote)
    ways = min(ways, total // PARALLEL_MIN_PART_BYTES)
    parts, li, ri = [], local, remote
    for k in range(ways, 0, -1):
        cut = -(-sum(n for _, n in li) // k)  # ceil: the last part takes the rest
        lh, li = _split(li, cut)
        rh, ri = _split(ri, cut)
        parts.append((lh, rh))
    futs = [_reader_pool().submit(vm_read, pid, lp, rp) for lp, rp in parts[1:]]
    results: list[int | BaseException] = []
    for run in [lambda: vm_read(pid, *parts[0])] + [f.result for f in futs]:
        try:  # every part finishes before this returns: none writes into freed pages
            results.append(run())
        except BaseException as e:  # noqa: BLE001 - re-raised below, once all parts ended
            results.append(e)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    if any(got < sum(n for _, n in lp) for got, (lp, _) in zip(results, parts)):
        return min(sum(results), total - 1)  # a part ran into unmapped memory: short
    return total


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _reader_pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max(1, READ_WAYS - 1), thread_name_prefix="kvstore-vm")
        return _POOL


def _advance(ranges: list[tuple[int, int]], nbytes: int) -> list[tuple[int, int]]:
    """``ranges`` without their first ``nbytes`` bytes."""
    out = list(ranges)
    while nbytes and out:
        a, n = out[0]
        if n <= nbytes:
            out.pop(0)
            nbytes -= n
        else:
            out[0] = (a + nbytes, n - nbytes)
            nbytes = 0
    return out


def address_of(buf) -> int:
    """Address of a writable or read-only buffer's first byte (a memoryview, bytes, or a numpy
    array); the caller keeps ``buf`` alive while the address is used."""
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


class PeerMemory:
    """The connected client process whose memory a put may be read from.

    Args:
        pid: the peer's pid (``SO_PEERCRED`` of the accepted socket).
        sock_fd: the connection's socket, watched for the peer closing it: a client closes
            its connection before its put call returns on an error (a timeout), after which
            its tensors may be freed, so a read the daemon finishes after that close is
            dropped.

    Raises:
        OSError: the process is gone (``pidfd_open``).
    """

    def __init__(self, pid: int, sock_fd: int | None = None):
        self.pid = pid
        self._pidfd = os.pidfd_open(pid)
        self._lock, self._closed = threading.Lock(), False  # (close vs a read's checks)
        self._poll = select.poll()
        self._poll.register(self._pidfd, select.POLLIN)
        self._hup = None
        if sock_fd is not None:
            self._hup = select.poll()
            self._hup.register(sock_fd, getattr(select, "POLLRDHUP", 0x2000))

    @classmethod
    def of_socket(cls, sock: socket.socket) -> "PeerMemory":
        """The peer of a connected Unix socket."""
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return cls(struct.unpack("3i", raw)[0], sock.fileno())

    def alive(self) -> bool:
        """True while the process this object was made for has not exited (its pid cannot
        name another process then); False once ``close`` ran."""
        with self._lock:
            return not self._closed and not self._poll.poll(0)

    def connected(self) -> bool:
        """True while the peer keeps the connection open and ``close`` has not run."""
        with self._lock:
            return not self._closed and (self._hup is None or not self._hup.poll(0))

    def probe(self, probe: Any) -> bool:
        """Whether ``probe`` (hello's ``vm_probe``) names bytes this daemon reads as given."""
        if not isinstance(probe, dict):
            return False
        addr, hexed = probe.get("address"), probe.get("hex")
        if type(addr) is not int or addr <= 0 or not isinstance(hexed, str):
            return False
        try:
            want = bytes.fromhex(hexed)
        except ValueError:
            return False
        if not 0 < len(want) <= PROBE_MAX_BYTES:
            return False
        got = bytearray(len(want))
        try:
            n = vm_read(self.pid, [(address_of(got), len(got))], [(addr, len(want))])
        except OSError:
            return False
        return n == len(want) and bytes(got) == want and self.alive()

    def read_into(self, dsts: Sequence[np.ndarray], remote: Sequence[tuple[int, int]]) -> None:
        """Copy the ``remote`` ranges, in order, into the ``dsts`` arrays (``np.uint8``, as
        many bytes in all).

        Raises:
            ProtocolError: 403 when the kernel refuses the read (the connection stops using
                reads then), 400 when a range is not the client's readable memory, 410 when
                the client exited or closed the connection during the read (what was read
                may be memory it freed: nothing is stored).
        """
        local: list[tuple[int, int]] = []
        for d in dsts:  # adjacent pages as one range: the kernel's cost is per range
            if not d.size:
                continue
            a = d.ctypes.data
            if local and local[-1][0] + local[-1][1] == a:
                local[-1] = (local[-1][0], local[-1][1] + d.size)
            else:
                local.append((a, d.size))
        total = sum(n for _, n in local)
        try:
            got = vm_read_parallel(self.pid, local, list(remote), READ_WAYS)
        except OSError as e:
            if e.errno in (errno.EPERM, errno.EACCES, errno.ESRCH, errno.ENOSYS):
                raise ProtocolError(f"the daemon may not read this client's memory ({e}); "
                                    "put from the staging area", 403) from None
            raise ProtocolError(f"put: a vm range is not readable memory of the client "
                                f"({e})") from None
        if not self.alive():
            raise ProtocolError("the client exited during its put", 410)
        if not self.connected():  # its call returned meanwhile: the bytes may be stale
            raise ProtocolError("the client closed the connection during its put; nothing "
                                "stored", 410)
        if got != total:
            raise ProtocolError(f"put: read {got} of {total} bytes from the client's memory "
                                "(a vm range runs into unmapped memory)")

    def close(self) -> None:
        """Close the pidfd; a read still running then ends in 410. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                os.close(self._pidfd)
            except OSError:
                pass


def parse_ranges(value: Any, entries) -> list[tuple[int, int]]:
    """A put's ``vm`` field: one ``[address, nbytes]`` per entry, ``nbytes`` the entry's.

    Raises:
        ProtocolError: anything else.
    """
    if not isinstance(value, list) or len(value) != len(entries):
        raise ProtocolError(f"put: 'vm' must list one [address, nbytes] per chunk "
                            f"({len(entries)})")
    out = []
    for r, e in zip(value, entries):
        if not (isinstance(r, list) and len(r) == 2 and type(r[0]) is int and type(r[1]) is int
                and 0 < r[0] < 1 << 64 and r[1] == e.nbytes):
            raise ProtocolError(f"put: bad vm range {str(r)[:60]} for a chunk of {e.nbytes} "
                                "bytes")
        out.append((r[0], r[1]))
    return out


def put_ranges(peer: PeerMemory | None, h: dict, entries, payload_left: int,
               max_bytes: int) -> list[tuple[int, int]]:
    """The checked ``vm`` ranges of put header ``h`` on a connection whose peer is ``peer``.

    Raises:
        ProtocolError: no readable peer (``hello`` gave no working ``vm_probe``), a payload or
            ``staging_offset`` too, more than ``max_bytes`` in all (413), or bad ranges.
    """
    if peer is None:
        raise ProtocolError("put: 'vm' on a connection whose hello did not establish vm reads "
                            "(vm_read false); put from the staging area", 403)
    if payload_left or h.get("staging_offset") is not None:
        raise ProtocolError("put: 'vm' takes no payload and no staging_offset")
    if h.get("pid") != peer.pid:  # e.g. a forked child using its parent's connection
        raise ProtocolError(f"put: 'vm' from pid {h.get('pid')!r}, but pid {peer.pid} "
                            "connected; put from the staging area", 403)
    ranges = parse_ranges(h.get("vm"), entries)
    total = sum(n for _, n in ranges)
    if total > max_bytes:
        raise ProtocolError(f"put: {total} vm bytes exceed {max_bytes}", 413)
    return ranges


def put_vm_direct(store, ns, entries, peer: PeerMemory, ranges: list[tuple[int, int]]):
    """A vm put into the top tier in one call on the store pool: reserve every chunk's pages,
    read each chunk from the client into them, commit the batch. Returns as
    ``shm_staging.put_direct`` (never a refused entry); raises as ``PeerMemory.read_into``
    (nothing is kept)."""
    def fill(items) -> None:
        dsts, remote = [], []
        for it, r in zip(items, ranges):
            if isinstance(it, Reservation):
                dsts += [np.frombuffer(v, dtype=np.uint8) for v in it.memoryviews()]
            elif isinstance(it, torch.Tensor):
                dsts.append(it.view(torch.uint8).reshape(-1).numpy())
            else:  # stored already, or no room anywhere
                continue
            remote.append(r)
        if remote:
            peer.read_into(dsts, remote)
    return put_direct(store, ns, entries, fill)


def read_all(peer: PeerMemory, ranges: list[tuple[int, int]]) -> np.ndarray:
    """The bytes of ``ranges`` read from the client into one new ``np.uint8`` array (the
    source of the general put path, as a staging area would be). Raises as ``read_into``."""
    buf = np.empty(sum(n for _, n in ranges), dtype=np.uint8)
    peer.read_into([buf], ranges)
    return buf


def allow_daemon_to_read(sock: socket.socket) -> None:
    """Under Yama ``ptrace_scope`` 1 (Ubuntu's default), name the daemon at the other end of
    ``sock`` this process's ptracer (``PR_SET_PTRACER``), which lets it read a put's tensors;
    nothing elsewhere (scope 0 needs nothing; scopes 2-3 refuse whatever is done here, and
    puts then go through the staging area). A process has one such exception: the last
    daemon named keeps it."""
    try:
        with open(_YAMA) as f:
            scope = f.read().strip()
    except OSError:
        return
    if scope != "1" or _LIBC is None:
        return
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid = struct.unpack("3i", raw)[0]
    if pid > 0:
        _LIBC.prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)


__all__ = ["IOV_MAX", "PROBE_MAX_BYTES", "PeerMemory", "address_of", "allow_daemon_to_read",
           "available", "parse_ranges", "put_ranges", "put_vm_direct", "read_all", "vm_read"]
