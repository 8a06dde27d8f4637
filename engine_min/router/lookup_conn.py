"""Kept-alive HTTP/1.1 connections for the router's store lookups (``POST /v1/lookup``).

A lookup sits on every routed request's path that asks the store, within a deadline of a
few milliseconds, so the router sends it on a connection of its own, kept open between
lookups, with its request line and headers built once: one ``write`` of header and body, and
the answer (``Content-Length`` or chunked) parsed as its bytes arrive, without the general
client's per-request work (``aiohttp.ClientSession.post``: request object, connector,
response object, several event-loop hops), which costs more CPU than the daemon's own
answer on a busy host (``bench/router_lookup.py``). The request goes out in the
caller's own step of the event loop, before it first awaits.

A connection carries one request at a time; concurrent lookups open more (at most
``max_idle`` are kept). A connection whose request was cancelled (the lookup's deadline) is
closed, never reused: its late answer would be read as the next request's. A kept connection
the daemon closed meanwhile (its idle timeout) fails as the request goes out or before any byte
of the answer came back; the lookup, which changes nothing on the daemon, is then sent once
more on a new connection.
"""
from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit


class LookupAnswerError(ValueError):
    """An answer that is not HTTP/1.x as the daemon sends it (bad status line, framing)."""


class _Conn(asyncio.Protocol):
    """One connection; ``request`` sends a request and returns ``(status, body)``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = True
        self._buf = bytearray()
        self._answer: asyncio.Future | None = None
        self._got_bytes = False

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        self._buf += data
        if self._answer is None or self._answer.done():
            return
        try:
            done = self._parse()
        except LookupAnswerError as exc:
            self.reusable = False
            self._answer.set_exception(exc)
            return
        if done is not None:
            self._answer.set_result(done)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self._answer is not None and not self._answer.done():
            err = ConnectionResetError(f"the daemon closed the lookup connection ({exc!r})")
            err.before_answer = not self._got_bytes      # type: ignore[attr-defined]
            self._answer.set_exception(err)

    # -- one request -----------------------------------------------------------------------
    def send(self, data: bytes) -> asyncio.Future:
        """Write ``data`` (a whole request) now; the future gets ``(status, body)``."""
        self._buf.clear()
        self._got_bytes = False
        self._answer = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self._answer

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _parse(self) -> tuple[int, bytes] | None:
        """``(status, body)`` once the whole answer is in ``_buf``, else None."""
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > 65536:
                raise LookupAnswerError("answer headers longer than 64 KiB")
            return None
        head = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
        parts = head[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise LookupAnswerError(f"not an HTTP/1.x status line: {head[0][:80]!r}")
        length, chunked = None, False
        for line in head[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "content-length":
                if not value.isdigit():
                    raise LookupAnswerError(f"bad Content-Length {value[:40]!r}")
                length = int(value)
            elif name == "transfer-encoding":
                chunked = "chunked" in value
            elif name == "connection" and value == "close":
                self.reusable = False
        if parts[0] == "HTTP/1.0":
            self.reusable = False
        start = end + 4
        if chunked:
            body = self._dechunk(start)
        elif length is not None:
            body = bytes(self._buf[start:start + length]) \
                if len(self._buf) >= start + length else None
        else:
            raise LookupAnswerError("answer without Content-Length or chunked framing")
        return None if body is None else (int(parts[1]), body)

    def _dechunk(self, pos: int) -> bytes | None:
        out = bytearray()
        while True:
            eol = self._buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            size_text = bytes(self._buf[pos:eol]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise LookupAnswerError(f"bad chunk size {size_text[:20]!r}") from None
            pos = eol + 2
            if size == 0:
                return bytes(out) if self._buf.find(b"\r\n", pos) >= 0 else None
            if len(self._buf) < pos + size + 2:
                return None
            out += self._buf[pos:pos + size]
            pos += size + 2


class LookupConnections:
    """``POST`` requests to one ``http://host:port`` daemon on kept-alive connections.

    Args:
        url: the daemon's base URL, ``http://host[:port]`` (https is not handled here).
        headers: headers of every request (``Content-Length`` and ``Host`` are added).
        max_idle: connections kept open between requests.

    Raises:
        ValueError: a URL that is not ``http://host[:port]``.
    """

    def __init__(self, url: str, headers: dict[str, str], max_idle: int = 4):
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected http://host[:port], got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._head = "".join(f"{k}: {v}\r\n" for k, v in
                             {"Host": f"{host}:{self.port}", **headers}.items())
        self.max_idle = max_idle
        self._idle: list[_Conn] = []
        #: connections opened so far (a kept connection is not counted again)
        self.opened = 0
        #: ``(seconds from the write to the whole answer, seconds parsing it)`` of the last
        #: request, or None
        self.last_timing: tuple[float, float] | None = None

    def request_bytes(self, path: str, body: bytes) -> bytes:
        """The whole ``POST path`` request with ``body``."""
        return (f"POST {path} HTTP/1.1\r\n{self._head}Content-Length: {len(body)}\r\n\r\n"
                ).encode("latin-1") + body

    async def _open(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Conn, self.host, self.port)
        self.opened += 1
        return conn

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """``(status, body)`` of ``POST path``. A kept connection found closed before the
        answer began is replaced once (the request is safe to repeat: lookups change
        nothing). Cancelling (a deadline) closes the connection in use.

        Raises:
            OSError: the daemon cannot be reached, or closed a new connection.
            LookupAnswerError: an answer that is not HTTP/1.x as expected.
        """
        data = self.request_bytes(path, body)
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and not conn.transport.is_closing():
                break
        else:
            conn = None
        if conn is not None:
            try:
                return await self._exchange(conn, data)
            except ConnectionResetError as exc:
                if not getattr(exc, "before_answer", False):
                    raise
        return await self._exchange(await self._open(), data)

    async def _exchange(self, conn: _Conn, data: bytes) -> tuple[int, bytes]:
        t0 = time.perf_counter()
        try:
            status, answer = await conn.send(data)
        except BaseException:
            conn.close()
            raise
        t1 = time.perf_counter()
        if conn.reusable and not conn.closed and len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.close()
        self.last_timing = (t1 - t0, 0.0)
        return status, answer

    def close(self) -> None:
        """Close the kept connections."""
        while self._idle:
            self._idle.pop().close()
