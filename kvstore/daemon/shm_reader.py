"""The daemon's read side of one same-host connection (``kvstore.daemon.shm_session``): the
request stream of a raw non-blocking Unix socket, read ahead.

Requests are read ahead into a buffer (``[_rpos, _rend)`` of ``_rbuf`` received, not yet
consumed; ``_base`` is the stream offset of ``_rbuf[0]``), so a key request's preamble and
header arrive in one call. Those reads take descriptors too (``SCM_RIGHTS``: a ``stage``
request's payload byte carries its memfd): they ride on the first byte of the message that
carried them, and the kernel ends a read after that message (or where the buffer ends), so
that byte lies in the read's stream range; they are kept by that range until ``recv_fds``
consumes a byte in it, and closed once the stream passes its end or the reader closes. At
most ``MAX_HELD_FDS`` are kept at once; more are closed as they arrive.

The event loop watches the socket through one reader callback that stays registered between
requests (no ``epoll_ctl`` per request) and runs the waiting read itself, so its bytes are
taken before the loop polls again; with no read waiting (the connection is busy elsewhere) the
callback stops watching until the next read.
"""
from __future__ import annotations

import array
import asyncio
import os
import socket
from typing import Any, Callable

from kvstore.daemon import shm_protocol as S
from kvstore.daemon.protocol import PREAMBLE_BYTES, decode_preamble

#: Bytes a read may take ahead of what it needs (a request's preamble and header, 0.1-8 KB,
#: then arrive in one call; read-ahead payload bytes are copied out first).
READ_AHEAD_BYTES = 64 << 10
#: Ancillary room of a read-ahead call: up to 16 descriptors (``stage`` passes one).
_ANC_SPACE = socket.CMSG_SPACE(16 * array.array("i").itemsize)
#: Descriptors a connection's read-ahead keeps at most; more that arrive are closed at once
#: (a client attaching descriptors to every byte of a frame filled the daemon's table).
MAX_HELD_FDS = 16


class SocketReader:
    """Reads one connection's requests (module docstring). Used by one task at a time.

    Args:
        loop: the running event loop. sock: the connection's non-blocking socket (not
            closed here).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        self.loop, self.sock, self._fd = loop, sock, sock.fileno()
        self._rbuf = bytearray(READ_AHEAD_BYTES)
        self._rview = memoryview(self._rbuf)
        self._rpos = self._rend = self._base = 0
        #: descriptors read ahead: (first and last stream offsets of the read, fds)
        self._fds: list[tuple[int, int, list[int]]] = []
        #: the loop watches the socket (``_on_readable``); the read waiting for it, if any
        self._watching, self._reading = False, None

    # ---- waiting -----------------------------------------------------------------------------
    async def _io(self, read: Callable[[], Any] | None) -> Any:
        """``read()`` (a non-blocking read of the socket) now, or once the socket is readable,
        run by the loop's reader callback; ``read`` None: only wait until it is readable.

        Raises:
            what ``read`` raises (but ``BlockingIOError``).
        """
        if read is not None:
            try:
                return read()
            except (BlockingIOError, InterruptedError):
                pass
        done = self.loop.create_future()
        self._reading = (done, read)
        if not self._watching:
            self.loop.add_reader(self._fd, self._on_readable)
            self._watching = True
        try:
            return await done
        finally:
            self._reading = None

    def _on_readable(self) -> None:
        """The loop's reader callback: run the waiting read; none waiting: stop watching
        (the socket stays readable until someone reads)."""
        if self._reading is None:
            self.unwatch()
            return
        done, read = self._reading
        if done.done():
            return
        try:
            done.set_result(None if read is None else read())
        except (BlockingIOError, InterruptedError):
            pass
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the reading task
            done.set_exception(e)

    def unwatch(self) -> None:
        """Stop the loop watching the socket (before others read it with the loop's own
        ``sock_recv_into``, and before it closes); the next read watches it again."""
        if self._watching:
            self._watching = False
            self.loop.remove_reader(self._fd)

    def close(self) -> None:
        """Stop watching and close the descriptors read ahead that nobody took."""
        self.unwatch()
        for _first, _last, fds in self._fds:
            close_all(fds)
        self._fds = []

    def buffered(self) -> bool:
        """Whether bytes read ahead wait to be consumed (a request begun or queued)."""
        return self._rend > self._rpos

    # ---- the read-ahead buffer ---------------------------------------------------------------
    def _recv_ahead(self) -> int:
        """One read into ``_rbuf[_rend:]`` (descriptors kept in ``_fds``); returns its bytes.

        Raises:
            BlockingIOError: nothing to read. ConnectionError: the client closed.
        """
        n, anc, _flags, _addr = self.sock.recvmsg_into([self._rview[self._rend:]], _ANC_SPACE)
        fds = fds_of(anc) if anc else None
        if n == 0:
            close_all(fds or ())
            raise ConnectionError("client closed the connection")
        if fds:
            if sum(len(f) for _first, _last, f in self._fds) + len(fds) > MAX_HELD_FDS:
                close_all(fds)
            else:
                first = self._base + self._rend
                self._fds.append((first, first + n - 1, fds))
        self._rend += n
        return n

    async def _fill(self, need: int) -> None:
        """Have at least ``need`` received bytes at ``_rbuf[_rpos:]`` (reading ahead as far
        as the buffer allows).

        Raises:
            ConnectionError: the client closed the connection first.
        """
        while (have := self._rend - self._rpos) < need:
            if self._rpos and self._rpos + need > len(self._rbuf):  # move what is left to the front
                self._rbuf[:have] = self._rbuf[self._rpos:self._rend]
                self._base += self._rpos
                self._rpos, self._rend = 0, have
            if self._rend == len(self._rbuf):  # full: grow as bytes arrive, never ahead of them
                grown = bytearray(min(need, 2 * len(self._rbuf)))  # (a header's declared size
                grown[:have] = self._rview[:have]                  # is the client's word only)
                self._rbuf, self._rview = grown, memoryview(grown)
            await self._io(self._recv_ahead)

    def _take(self, n: int) -> None:
        """Consume ``n`` read-ahead bytes."""
        self._rpos += n
        if self._rpos == self._rend:  # empty: the next read lands at the front
            self._base += self._rpos
            self._rpos = self._rend = 0
            if len(self._rbuf) > READ_AHEAD_BYTES:  # grown for one large header: give it back
                self._rbuf = bytearray(READ_AHEAD_BYTES)
                self._rview = memoryview(self._rbuf)

    def _fds_at(self, offset: int) -> list[int]:
        """The read-ahead descriptors of the read whose range holds stream ``offset``; those
        of reads that end before it (nobody took them) are closed."""
        mine, kept = [], []
        for first, last, fds in self._fds:
            if last < offset:
                close_all(fds)
            elif first <= offset:
                mine += fds
            else:
                kept.append((first, last, fds))
        self._fds = kept
        return mine

    def _close_fds_before(self, offset: int) -> None:
        """Close the read-ahead descriptors of reads that end before stream ``offset``."""
        if any(last < offset for _first, last, _fds in self._fds):
            for _first, last, fds in self._fds:
                if last < offset:
                    close_all(fds)
            self._fds = [r for r in self._fds if r[1] >= offset]

    # ---- reads -------------------------------------------------------------------------------
    async def read_frame(self, timeout_s: float | None = None) -> tuple[dict, int] | None:
        """The next request's ``(header, payload bytes)``, or None at a clean end. Waits for
        the frame's first byte as long as it takes (an idle connection), then at most
        ``timeout_s`` seconds (None: no limit) for the rest of its preamble and header.

        Raises:
            ProtocolError: a malformed preamble or header. ConnectionError: the stream ended
                inside the header. TimeoutError: the frame's preamble and header did not
                arrive within ``timeout_s`` of its first byte.
        """
        if self._fds:  # descriptors of bytes consumed without taking them
            self._close_fds_before(self._base + self._rpos)
        try:
            await self._fill(1)
        except ConnectionError:
            return None
        have, pos = self._rend - self._rpos, self._rpos
        n = decode_preamble(self._rbuf[pos:pos + PREAMBLE_BYTES]) if have >= PREAMBLE_BYTES \
            else -1
        if n < 0 or have < PREAMBLE_BYTES + n:  # the rest of the frame's head is on its way
            async with asyncio.timeout(timeout_s):
                try:
                    await self._fill(PREAMBLE_BYTES)
                except ConnectionError:
                    return None
                pos = self._rpos
                n = decode_preamble(self._rbuf[pos:pos + PREAMBLE_BYTES])
                await self._fill(PREAMBLE_BYTES + n)  # (may move the bytes to the front)
        pos = self._rpos + PREAMBLE_BYTES
        header = self._rbuf[pos:pos + n]
        self._take(PREAMBLE_BYTES + n)
        return S.decode_header(header)

    async def recv_some(self, view: memoryview) -> int:
        """Read at least one byte into ``view`` (read-ahead bytes first); returns how many.
        Callers bound ``view`` by the request's payload, so a read from the socket never
        passes the request's end.

        Raises:
            ConnectionError: the client closed the connection.
        """
        have = self._rend - self._rpos
        if have:
            n = min(have, len(view))
            view[:n] = self._rview[self._rpos:self._rpos + n]
            self._take(n)
            return n
        n = await self._io(lambda: self.sock.recv_into(view))
        if n == 0:
            raise ConnectionError("client closed the connection")
        self._base += n  # (the buffer is empty: its next byte follows these)
        return n

    async def recv_fds(self) -> list[int]:
        """Read one byte with the descriptors it carries (``SCM_RIGHTS``); the caller closes
        them.

        Raises:
            ConnectionError: the client closed the connection.
        """
        if self._rend > self._rpos:  # read ahead, with its descriptors (if any)
            fds = self._fds_at(self._base + self._rpos)
            self._take(1)
            return fds
        if self._fds:  # left by bytes consumed already
            self._close_fds_before(self._base)
        room = socket.CMSG_SPACE(4 * array.array("i").itemsize)
        while True:  # (read here, not in the reader callback: a cancelled wait leaks nothing)
            try:
                msg, anc, _flags, _addr = self.sock.recvmsg(1, room)
                break
            except (BlockingIOError, InterruptedError):
                await self._io(None)
        fds = fds_of(anc)
        if not msg:
            close_all(fds)
            raise ConnectionError("client closed the connection")
        self._base += len(msg)  # (the buffer is empty: its next byte follows this one)
        return fds

    async def recv_exact(self, n: int) -> bytes:
        """The next ``n`` bytes of the stream (read-ahead bytes first).

        Raises:
            ConnectionError: the client closed the connection first.
        """
        await self._fill(n)
        out = bytes(self._rview[self._rpos:self._rpos + n])
        self._take(n)
        return out


def fds_of(anc: list) -> list[int]:
    """The descriptors in a ``recvmsg`` call's ancillary data (``SCM_RIGHTS``)."""
    fds = array.array("i")
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return list(fds)


def close_all(fds) -> None:
    """Close each descriptor of ``fds`` (ignoring ones closed already)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


__all__ = ["MAX_HELD_FDS", "READ_AHEAD_BYTES", "SocketReader", "close_all", "fds_of"]
