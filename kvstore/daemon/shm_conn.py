"""One connection of the same-host client (``kvstore.daemon.shm_client``): a Unix socket that
said ``hello``, the daemon's CPU arena mapped read-only, and blocking exchanges bounded by a
deadline. Framing is ``kvstore.daemon.shm_protocol``'s.
"""
from __future__ import annotations

import mmap
import os
import socket
import time
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvstore.daemon import shm_protocol as S
from kvstore.daemon.protocol import MAGIC, MAX_HEADER_BYTES, PREAMBLE, ProtocolError
from kvstore.errors import RemoteError

#: Socket buffer asked for in each direction (bytes): a put's chunk (5.9 MB for SmolLM2)
#: crosses in a few system calls instead of hundreds of 208 KiB ones.
SOCKET_BUFFER_BYTES = 4 << 20


def unix_path(url: str) -> str:
    """The socket path of ``unix:///PATH`` (or a bare absolute ``PATH``).

    Raises:
        ValueError: anything else (a relative path, a host part, an empty path).
    """
    want = f"malformed kvstore unix socket URL {url!r}: expected unix:///ABSOLUTE/PATH"
    if not isinstance(url, str):
        raise ValueError(want)
    path = url[len("unix://"):] if url.startswith("unix://") else url
    if not path.startswith("/") or "\0" in path:
        raise ValueError(want)
    return path


class Arena:
    """The daemon's CPU arena (a memfd) mapped read-only into this process.

    Attributes:
        instance: the daemon start it belongs to (``hello``'s ``instance``).
        nbytes: the arena's size in bytes (0: the daemon has no CPU tier; no mapping).
        array: ``np.uint8`` array ``[nbytes]`` over the mapping (not writable), or None.
    """

    def __init__(self, instance: str, fd: int | None, nbytes: int):
        self.instance, self.nbytes, self.array = instance, nbytes, None
        self._mm = None
        if nbytes:
            if fd is None:
                raise ProtocolError(f"hello announced an arena of {nbytes} bytes but passed "
                                    "no descriptor")
            self._mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            self.array = np.frombuffer(self._mm, dtype=np.uint8)  # [nbytes], read-only

    def tensor(self):
        """A ``torch.uint8`` tensor ``[nbytes]`` over the read-only mapping (writing into it
        faults; torch's warning about non-writable arrays is silenced here only)."""
        import torch
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self.array)

    def copy_runs(self, runs: Sequence, dst: np.ndarray) -> None:
        """Copy arena byte runs ``[[offset, nbytes], ...]`` into ``dst`` (``np.uint8`` of
        exactly their total size), adjacent runs merged into one copy.

        Raises:
            ProtocolError: a malformed run, one outside the arena, or runs whose sizes do not
                add up to ``dst.size``.
        """
        if self.array is None:
            raise ProtocolError("a get answered with arena runs but the daemon has no arena")
        merged: list[list[int]] = []
        for r in runs:
            if not (isinstance(r, list) and len(r) == 2 and type(r[0]) is int
                    and type(r[1]) is int and r[0] >= 0 and r[1] > 0
                    and r[0] + r[1] <= self.nbytes):
                raise ProtocolError(f"bad arena run {str(r)[:60]} (arena of {self.nbytes} "
                                    "bytes)")
            if merged and merged[-1][0] + merged[-1][1] == r[0]:
                merged[-1][1] += r[1]
            else:
                merged.append([r[0], r[1]])
        if sum(n for _, n in merged) != dst.size:
            raise ProtocolError(f"arena runs hold {sum(n for _, n in merged)} bytes; the chunk "
                                f"has {dst.size}")
        pos, src = 0, self.array
        for off, n in merged:
            np.copyto(dst[pos:pos + n], src[off:off + n])
            pos += n


@dataclass(eq=False)
class Hello:
    """What ``hello`` answered: the daemon's start id, the token's tenant and the arena."""

    instance: str
    tenant: dict
    arena: Arena
    page_bytes: int


class Conn:
    """A connected, greeted socket. Not thread-safe: one caller at a time (the client's pool
    hands each connection to one call). Every blocking step waits at most until the deadline
    given (``time.monotonic()`` seconds) and raises ``TimeoutError`` past it.

    Raises (constructor): FileNotFoundError / ConnectionRefusedError (no daemon listens),
    PermissionError, TimeoutError, ConnectionError, ProtocolError, RemoteError (hello refused:
    401 token, 403 uid).
    """

    def __init__(self, path: str, token: str | None, deadline: float, arenas: dict):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        #: the put staging area passed to the daemon (``kvstore.daemon.shm_put``), if any
        self.staging = None
        #: True once the daemon (or this system) refused a staging area: put over the socket
        self.staging_refused = False
        try:
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                self.sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
            self._until(deadline)
            self.sock.connect(path)
            self.hello = self._hello(token, deadline, arenas)
        except BaseException:
            self.sock.close()
            raise

    def _hello(self, token: str | None, deadline: float, arenas: dict) -> Hello:
        self.send([S.encode_frame({"op": "hello", "version": S.SHM_VERSION, "token": token})],
                  deadline)
        fds: list[int] = []
        try:
            self._until(deadline)
            reply, n = S.recv_frame(self.sock, fds)
            reply = self.check(reply, n)
            instance, size = reply.get("instance"), reply.get("arena_bytes", 0)
            if not isinstance(instance, str) or type(size) is not int or size < 0:
                raise ProtocolError(f"malformed hello reply {str(reply)[:200]}")
            arena = arenas.get("current")
            if arena is None or arena.instance != instance:  # first hello, or a restart
                arena = Arena(instance, fds[0] if fds else None, size)
                arenas["current"] = arena
        finally:
            for fd in fds:  # a live mapping keeps the memfd; the descriptor is not needed
                os.close(fd)
        tenant = reply.get("tenant") if isinstance(reply.get("tenant"), dict) else {}
        return Hello(instance, tenant, arena, int(reply.get("page_bytes") or 0))

    def _until(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        self.sock.settimeout(left)

    def send(self, parts: list, deadline: float) -> None:
        """Send ``parts`` (bytes / memoryviews) in order with ``sendmsg`` (no join copy)."""
        parts = [memoryview(p).cast("B") for p in parts]
        while parts:
            self._until(deadline)
            sent = self.sock.sendmsg(parts[:512])
            while sent and parts:
                if sent >= parts[0].nbytes:
                    sent -= parts[0].nbytes
                    parts.pop(0)
                else:
                    parts[0] = parts[0][sent:]
                    sent = 0
            while parts and not parts[0].nbytes:
                parts.pop(0)

    def request(self, header: dict | bytes, deadline: float, payload: Sequence = ()) -> dict:
        """Send one request (a header dict, or a ready frame) and read its reply's header;
        an ``ok`` reply's payload, if any, is left in the socket (``recv_into``).

        Raises:
            RemoteError: an error reply. TimeoutError, ConnectionError, ProtocolError.
        """
        self.send([header if isinstance(header, bytes) else S.encode_frame(header)]
                  + list(payload), deadline)
        return self.reply(deadline)

    def reply(self, deadline: float) -> dict:
        """Read the next reply's header (after requests sent with ``send``); raises as
        ``request``."""
        self._until(deadline)
        reply, n = S.recv_frame(self.sock)
        return self.check(reply, n)

    def send_fds(self, data: bytes, fds: list[int], deadline: float) -> None:
        """Send ``data`` with ``fds`` attached (``SCM_RIGHTS``), in a message of its own."""
        self._until(deadline)
        S.send_with_fds(self.sock, data, fds)

    def check(self, reply: dict, payload_bytes: int) -> dict:
        """``reply`` if ``ok``; else its payload is skipped and ``RemoteError`` raised."""
        if reply.get("ok") is True:
            reply["payload_bytes"] = payload_bytes
            return reply
        if payload_bytes:
            S.recv_exact(self.sock, payload_bytes)
        status = reply.get("status")
        raise RemoteError(status if type(status) is int else 500,
                          str(reply.get("error", "error reply without a message")))

    def alive(self) -> bool:
        """False when the daemon has closed this (idle) connection or sent on it unasked."""
        try:
            self.sock.setblocking(False)  # (with a timeout set, Python would wait for data)
            self.sock.recv(1, socket.MSG_PEEK)  # b"": closed; bytes: out of step
        except BlockingIOError:
            return True  # nothing to read: open and in step
        except OSError:
            pass
        return False

    def recv_into(self, view: memoryview, deadline: float) -> None:
        self._until(deadline)
        S.recv_exact_into(self.sock, view)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        if self.staging is not None:
            self.staging.close()
            self.staging = None


def key_frame(op: str, key_request_json: bytes) -> bytes:
    """The frame of a key request: ``key_request_json`` (``fields.key_request``'s JSON object
    bytes) with ``"op"`` put first, without re-encoding it (a lookup of 32 keys is a few
    microseconds of client time).

    Raises:
        ProtocolError: a header larger than ``MAX_HEADER_BYTES``.
    """
    blob = b'{"op":"' + op.encode() + b'",' + key_request_json[1:]
    if len(blob) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(blob)} bytes exceeds {MAX_HEADER_BYTES}")
    return PREAMBLE.pack(MAGIC, len(blob)) + blob
