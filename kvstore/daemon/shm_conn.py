"""One connection of the same-host client (``kvstore.daemon.shm_client``): a Unix socket that
said ``hello``, the daemon's CPU arena mapped read-only, and blocking exchanges bounded by a
deadline. Framing is ``kvstore.daemon.shm_protocol``'s.
"""
from __future__ import annotations

import math
import os
import select
import socket
import time
from dataclasses import dataclass, field
from typing import Sequence

from kvstore.daemon.batches import DaemonLimits, limits_from
from kvstore.daemon import shm_protocol as S
from kvstore.daemon import shm_vm
from kvstore.daemon.shm_arena import Arena, unix_path  # noqa: F401 (re-exported)
from kvstore.daemon.protocol import (MAGIC, MAX_HEADER_BYTES, PREAMBLE, PREAMBLE_BYTES,
                                     ProtocolError, decode_preamble)
from kvstore.errors import RemoteError

#: Socket buffer asked for in each direction (bytes): a put's chunk (5.9 MB for SmolLM2)
#: crosses in a few system calls instead of hundreds of 208 KiB ones.
SOCKET_BUFFER_BYTES = 4 << 20
#: Bytes a reply read may take ahead of what it needs (a reply's header, 0.1-8 KB, then
#: arrives in one call; read-ahead bytes of a payload are copied out first).
READ_AHEAD_BYTES = 64 << 10


@dataclass(eq=False)
class Hello:
    """What ``hello`` answered: the daemon's start id, the token's tenant, the arena and the
    protocol version agreed on."""

    instance: str
    tenant: dict
    arena: Arena
    page_bytes: int
    version: int = 1
    #: the daemon reads this client's puts from its memory (``kvstore.daemon.shm_vm``)
    vm_read: bool = False
    #: the daemon's request limits (None: an older daemon's hello does not name them)
    limits: DaemonLimits | None = None
    #: ``{"tier_codecs", "wire_codecs"}`` as ``GET /v1/whoami`` (empty from an older daemon)
    codecs: dict = field(default_factory=dict)


class Conn:
    """A connected, greeted socket. Not thread-safe: one caller at a time (the client's pool
    hands each connection to one call). Every blocking step waits at most until the deadline
    given (``time.monotonic()`` seconds) and raises ``TimeoutError`` past it.

    Raises (constructor): FileNotFoundError / ConnectionRefusedError (no daemon listens),
    PermissionError, TimeoutError, ConnectionError, ProtocolError, RemoteError (hello refused:
    401 token, 403 uid, 400 a protocol ``version`` the daemon does not serve).
    """

    def __init__(self, path: str, token: str | None, deadline: float, arenas: dict,
                 version: int = S.SHM_VERSION, vm_put: bool = True):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        #: the put staging area passed to the daemon (``kvstore.daemon.shm_put``), if any
        self.staging = None
        #: True once the daemon (or this system) refused a staging area: put over the socket
        self.staging_refused = False
        #: True once the daemon refused to read a put from this process (403): staging then
        self.vm_refused = False
        #: the process that connected (a forked child must not have its puts read from here)
        self.pid = os.getpid()
        # read-ahead of reply frames: [_rpos, _rend) of _rbuf are received, not yet consumed
        self._rbuf, self._rpos, self._rend = bytearray(READ_AHEAD_BYTES), 0, 0
        #: frames that need no reply (``release``), sent ahead of the next request
        self._pending: list[bytes] = []
        #: ``time.monotonic()`` when the oldest of ``_pending`` was deferred
        self.pending_since = 0.0
        try:
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                self.sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            self.sock.settimeout(left)
            self.sock.connect(path)
            # non-blocking from here on: each wait is one poll() bounded by the deadline
            # (a socket with a timeout would poll before every call and reset it each time)
            self.sock.setblocking(False)
            fd = self.sock.fileno()
            self._poll_in, self._poll_out = select.poll(), select.poll()
            self._poll_in.register(fd, select.POLLIN)
            self._poll_out.register(fd, select.POLLOUT)
            self.hello = self._hello(token, deadline, arenas, version, vm_put)
        except BaseException:
            self.sock.close()
            raise

    def _hello(self, token: str | None, deadline: float, arenas: dict, version: int,
               vm_put: bool) -> Hello:
        head: dict = {"op": "hello", "version": version, "token": token}
        probe = None
        if vm_put and version >= 3 and shm_vm.available():
            shm_vm.allow_daemon_to_read(self.sock)
            probe = bytearray(os.urandom(32))  # read back by the daemon (kept alive till then)
            head["vm_probe"] = {"address": shm_vm.address_of(probe), "hex": probe.hex()}
        self.send([S.encode_frame(head)], deadline)
        fds: list[int] = []
        try:
            while True:  # the arena's descriptor rides on the reply's first bytes
                try:
                    data, got = S.recv_with_fds(self.sock, len(self._rbuf))
                    break
                except BlockingIOError:
                    self._wait(self._poll_in, deadline)
            fds.extend(got)
            self._rbuf[:len(data)], self._rend = data, len(data)
            reply = self.reply(deadline)
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
        agreed = reply.get("version", 1)
        if agreed not in S.SHM_VERSIONS or agreed > version:
            raise ProtocolError(f"hello answered version {agreed!r} to a client of {version}")
        return Hello(instance, tenant, arena, int(reply.get("page_bytes") or 0), agreed,
                     probe is not None and reply.get("vm_read") is True, limits_from(reply),
                     {k: reply[k] for k in ("tier_codecs", "wire_codecs") if k in reply})

    @staticmethod
    def _wait(poller, deadline: float) -> None:
        """Wait until ``poller``'s event (or an error/hang-up) on the socket; TimeoutError
        past the deadline."""
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(max(1, math.ceil(left * 1e3))):
            raise TimeoutError("deadline passed")

    def defer(self, frame: bytes) -> None:
        """Send ``frame`` (one that gets no reply: ``release``) ahead of the next request on
        this connection, in the same system call, or by ``flush``: one send and one wake-up
        of the daemon fewer per get (``kvstore.daemon.shm_release`` flushes a connection left
        idle)."""
        if not self._pending:
            self.pending_since = time.monotonic()
        self._pending.append(frame)

    @property
    def has_pending(self) -> bool:
        """Whether deferred frames wait for the next send."""
        return bool(self._pending)

    def flush(self, deadline: float) -> None:
        """Send the deferred frames now (nothing when there are none)."""
        if self._pending:
            self.send([], deadline)

    def send(self, parts: list, deadline: float) -> None:
        """Send ``parts`` (bytes / memoryviews) in order with ``sendmsg`` (no join copy),
        after the deferred frames."""
        if self._pending:
            parts, self._pending = [*self._pending, *parts], []
        parts = [memoryview(p).cast("B") for p in parts]
        while parts:
            try:
                sent = self.sock.sendmsg(parts[:512])
            except BlockingIOError:
                self._wait(self._poll_out, deadline)
                continue
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
        an ``ok`` reply's payload, if any, is left to ``recv_into``.

        Raises:
            RemoteError: an error reply. TimeoutError, ConnectionError, ProtocolError.
        """
        frame = header if isinstance(header, bytes) else S.encode_frame(header)
        if payload or self._pending:
            self.send([frame, *payload], deadline)
        else:  # a request's frame usually fits the socket buffer: one call
            try:
                sent = self.sock.send(frame)
            except BlockingIOError:
                sent = 0
            if sent < len(frame):
                self.send([memoryview(frame)[sent:]], deadline)
        return self.reply(deadline)

    def reply(self, deadline: float) -> dict:
        """Read the next reply's header (after requests sent with ``send``); raises as
        ``request``."""
        self._fill(PREAMBLE_BYTES, deadline)
        n = decode_preamble(self._rbuf[self._rpos:self._rpos + PREAMBLE_BYTES])
        self._fill(PREAMBLE_BYTES + n, deadline)  # (may move the bytes to the front)
        start = self._rpos
        blob = self._rbuf[start + PREAMBLE_BYTES:start + PREAMBLE_BYTES + n]
        self._rpos = start + PREAMBLE_BYTES + n
        reply, payload_bytes = S.decode_header(blob)
        return self.check(reply, payload_bytes, deadline)

    def _fill(self, need: int, deadline: float) -> None:
        """Have at least ``need`` received bytes at ``_rbuf[_rpos:]`` (reading ahead as far as
        the buffer allows: a reply's header usually arrives whole in one call)."""
        have = self._rend - self._rpos
        if have >= need:
            return
        if self._rpos + need > len(self._rbuf):  # move what is left to the front (or grow)
            rest = self._rbuf[self._rpos:self._rend]
            if need > len(self._rbuf):
                self._rbuf = bytearray(need)
            self._rbuf[:have], self._rpos, self._rend = rest, 0, have
        view = memoryview(self._rbuf)
        if not have:  # a reply not read yet has rarely arrived already: wait, then read
            self._wait(self._poll_in, deadline)
        while self._rend - self._rpos < need:
            try:
                k = self.sock.recv_into(view[self._rend:])
            except BlockingIOError:
                self._wait(self._poll_in, deadline)
                continue
            if k == 0:
                raise ConnectionError("daemon closed the connection")
            self._rend += k

    def send_fds(self, data: bytes, fds: list[int], deadline: float) -> None:
        """Send ``data`` with ``fds`` attached (``SCM_RIGHTS``), in a message of its own
        (deferred frames first, in one of theirs)."""
        self.flush(deadline)
        while True:  # the descriptors ride on the first byte; the rest goes plainly
            try:
                S.send_with_fds(self.sock, data[:1], fds)
                break
            except BlockingIOError:
                self._wait(self._poll_out, deadline)
        if len(data) > 1:
            self.send([data[1:]], deadline)

    def check(self, reply: dict, payload_bytes: int, deadline: float | None = None) -> dict:
        """``reply`` if ``ok``; else its payload is skipped and ``RemoteError`` raised."""
        if reply.get("ok") is True:
            reply["payload_bytes"] = payload_bytes
            return reply
        if payload_bytes:
            left = time.monotonic() + 10.0 if deadline is None else deadline
            self.recv_into(memoryview(bytearray(payload_bytes)), left)
        status = reply.get("status")
        raise RemoteError(status if type(status) is int else 500,
                          str(reply.get("error", "error reply without a message")))

    def alive(self) -> bool:
        """False when the daemon has closed this (idle) connection or sent on it unasked."""
        if self._rend > self._rpos:
            return False  # bytes nobody asked for: out of step
        try:
            self.sock.recv(1, socket.MSG_PEEK)  # b"": closed; bytes: out of step
        except BlockingIOError:
            return True  # nothing to read: open and in step
        except OSError:
            pass
        return False

    def recv_into(self, view: memoryview, deadline: float) -> None:
        """Fill ``view`` with the next payload bytes (read ahead ones first)."""
        pos, n = 0, view.nbytes
        have = self._rend - self._rpos
        if have:
            pos = min(have, n)
            view[:pos] = self._rbuf[self._rpos:self._rpos + pos]
            self._rpos += pos
        while pos < n:
            try:
                k = self.sock.recv_into(view[pos:])
            except BlockingIOError:
                self._wait(self._poll_in, deadline)
                continue
            if k == 0:
                raise ConnectionError("daemon closed the connection")
            pos += k

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

