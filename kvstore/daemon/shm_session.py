"""One connection of the daemon's same-host path (``kvstore.daemon.shm_server`` accepts it):
its raw non-blocking socket, its tenant (from ``hello``), its borrows, and its request loop.

Requests are served one at a time, each under the server's request timeout and counted in the
server's metrics (route ``shm_<op>``) and ``active`` requests. Errors the stream survives
(a bad field, an unknown op, a checksum mismatch) are answered and the request's unread
payload is drained; errors that lose the framing (a bad preamble or header, a payload over
``max_body_bytes``, a timeout mid-request) are answered, then the connection ends (after the
client closes, when it holds borrows: it may still be copying borrowed pages; that wait counts
in no request, so a SIGTERM drain does not wait for it).

Every wait on the client is bounded by the request timeout but one: the first byte of the
next request (a pooled connection idles between requests). The rest of a frame begun, a
payload declared (drained or not), and the send of a reply the socket did not take at once
must each complete within it, else the connection ends (504). A get is refused (429) while
the connection holds ``MAX_BORROWS`` borrows unreleased. A connection whose requests keep
arriving hands the event loop to the others at least every ``TURN_S``.
"""
from __future__ import annotations

import array
import asyncio
import logging
import socket
import time
from typing import TYPE_CHECKING, Any

from kvstore.daemon import shm_hello, shm_ops
from kvstore.daemon import shm_protocol as S
from kvstore.daemon.protocol import ProtocolError
from kvstore.daemon.shm_reader import SocketReader
from kvstore.daemon.tenants import OPEN, Forbidden, Tenant

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.daemon.shm_server import ShmServer

log = logging.getLogger("kvstore.daemon.shm_server")

#: Socket buffer asked for in each direction (bytes): a 5.9 MB chunk crosses in a few calls.
SOCKET_BUFFER_BYTES = 4 << 20
#: Borrows one connection may hold unreleased; a get beyond is answered 429 (a client holds
#: one per get in progress; one that never releases would grow the daemon without bound).
MAX_BORROWS = 1024
#: Seconds a connection serves requests without handing the event loop to others (a client
#: that keeps its socket full is answered without a single wait otherwise: it held the loop,
#: and HTTP and other connections went unanswered, for as long as it kept sending).
TURN_S = 0.002


class Connection:
    """One accepted client: its socket, tenant, borrows and request loop."""

    def __init__(self, server: "ShmServer", sock: socket.socket) -> None:
        self.server, self.sock = server, sock
        self.store, self.state = server.store, server.state
        self.loop = asyncio.get_running_loop()
        self.tenant: Tenant = OPEN
        #: the protocol version ``hello`` agreed on (``kvstore.daemon.shm_protocol``)
        self.version = 1
        #: the request's payload bytes still unread in the socket
        self.payload_left = 0
        self.borrows: dict[int, Any] = {}
        self._next_borrow = 1
        #: the client's put staging area (``stage``), ``np.uint8`` read-only, or None
        self.staging = None
        #: the client process a put may read from (``kvstore.daemon.shm_vm``), or None
        self.peer = None
        #: the request stream, read ahead (``kvstore.daemon.shm_reader``)
        self.reader = SocketReader(self.loop, sock)
        #: a reply could not be sent within the request timeout (the client reads nothing)
        self.send_stuck = False
        #: a fatal error ended the requests while borrows were held: the connection stays
        #: open (not served, not counted in flight) until the client closes it
        self.linger = False
        #: a request is being served (read whole, not yet answered)
        self.busy = False
        #: ``time.monotonic()`` when the connection was made or last finished a request
        self.idle_since = time.monotonic()
        sock.setblocking(False)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
            except OSError:
                pass

    # ---- I/O (reads: ``kvstore.daemon.shm_reader``) -------------------------------------------
    async def recv_some(self, view: memoryview) -> int:
        """Read at least one byte into ``view`` (read-ahead bytes first); returns how many.

        Raises:
            ConnectionError: the client closed the connection.
        """
        return await self.reader.recv_some(view)

    async def recv_payload(self, view: memoryview) -> int:
        """``recv_some`` of the request's payload (at most ``payload_left`` bytes)."""
        if len(view) > self.payload_left:
            raise ProtocolError(f"payload ends {len(view) - self.payload_left} bytes short of "
                                "what its header declares")
        n = await self.reader.recv_some(view)
        self.payload_left -= n
        return n

    async def recv_fds(self) -> list[int]:
        """Read the request's one payload byte with the descriptors it carries
        (``SCM_RIGHTS``); the caller closes them.

        Raises:
            ConnectionError: the client closed the connection.
        """
        fds = await self.reader.recv_fds()
        self.payload_left -= 1
        return fds

    async def recv_exact(self, n: int) -> bytes:
        return await self.reader.recv_exact(n)

    async def reply(self, header: dict, payload: list | tuple = (), fds: list[int] = ()) -> None:
        """Send one reply frame (``payload``: memoryviews of ``payload_bytes`` in all). What
        the socket does not take at once must go within the request timeout.

        Raises:
            TimeoutError: the client read too little of it in time (``send_stuck`` is set:
                the stream may end inside the frame). OSError: the connection failed.
        """
        head = S.encode_frame(header)
        if fds:
            sent = self.sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                               _fd_bytes(fds))])
            head = head[sent:]
        else:  # a reply's header usually fits the socket buffer: sent in this call
            try:
                head = head[self.sock.send(head):]
            except (BlockingIOError, InterruptedError):
                pass
        if not head and not payload:
            return
        try:
            async with asyncio.timeout(self.state.limits.request_timeout_s):
                if head:
                    await self.loop.sock_sendall(self.sock, head)
                for view in payload:
                    await self.loop.sock_sendall(self.sock, view)
        except TimeoutError:
            self.send_stuck = True
            raise

    async def read_frame(self, timeout_s: float | None = None) -> tuple[dict, int] | None:
        """The next request's ``(header, payload bytes)``, or None at a clean end; a frame
        begun must be whole within ``timeout_s`` (``SocketReader.read_frame``)."""
        return await self.reader.read_frame(timeout_s)

    async def drain_payload(self) -> None:
        """Read and drop the rest of the request's payload (callers bound the wait)."""
        scratch = memoryview(bytearray(min(self.payload_left, 256 << 10) or 1))
        while self.payload_left > 0:
            await self.recv_payload(scratch[:min(self.payload_left, len(scratch))])

    def idle(self) -> bool:
        """True when closing the connection loses its client nothing (the server's connection
        cap may close it: ``kvstore.daemon.conns``): no request in flight or begun (nothing
        read ahead, nothing unread in the socket), no borrow held (its client may be reading
        the pages), not ending after a fatal error. A client that closed its end is idle."""
        if self.busy or self.borrows or self.linger or self.reader.buffered():
            return False
        try:
            return not self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return True  # nothing sent: open and idle
        except OSError:
            return True  # broken already

    # ---- borrows -----------------------------------------------------------------------------
    def check_borrow_room(self) -> None:
        """Raises ProtocolError (429) when the connection holds ``MAX_BORROWS`` borrows."""
        if len(self.borrows) >= MAX_BORROWS:
            raise ProtocolError(f"{len(self.borrows)} borrows unreleased on this connection (at "
                                f"most {MAX_BORROWS}); release some before the next get", 429)

    def add_borrow(self, borrowed) -> int:
        """Register a get's ``BorrowedChunks``; returns its id for ``release``."""
        bid = self._next_borrow
        self._next_borrow += 1
        self.borrows[bid] = borrowed
        return bid

    def release_borrow(self, bid: Any) -> None:
        """Drop borrow ``bid`` (unknown ids are ignored: ``release`` has no reply)."""
        b = self.borrows.pop(bid, None) if type(bid) is int else None
        if b is not None:
            self.release_soon(b)

    def release_soon(self, b) -> None:
        """Release ``b`` inline when that cannot wait (``BorrowedChunks.try_release``), else
        on the store pool."""
        if b.try_release():
            return
        try:
            self.state.pool.submit(b.release)
        except RuntimeError:  # pool shut down (the server is stopping): release here
            b.release()

    def close(self) -> None:
        for b in self.borrows.values():
            self.release_soon(b)
        self.borrows.clear()
        self.staging = None
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        self.reader.close()
        self.sock.close()

    # ---- protocol ------------------------------------------------------------------------------
    async def hello(self) -> bool:
        """Read and answer ``hello`` (``kvstore.daemon.shm_hello``); False when the
        connection must close (answered with the reason)."""
        return await shm_hello.hello(self)

    async def serve(self) -> None:
        """Answer requests until the client closes or a fatal error (after which, with
        borrows held, the connection waits for the client to close: ``wait_for_close``,
        counted in no request)."""
        await self._serve()
        if self.linger and self.borrows:
            await self.wait_for_close()

    async def _serve(self) -> None:
        timeout_s, loop = self.state.limits.request_timeout_s, self.loop
        turn_ends = loop.time() + TURN_S
        while True:
            try:
                frame = await self.read_frame(timeout_s)
            except ProtocolError as e:  # the stream's framing is lost
                await self._fatal(400, str(e))
                return
            except TimeoutError:  # a frame begun, then stalled: its buffer is not kept
                await self._fatal(504, f"request frame incomplete {timeout_s} s after its "
                                       "first byte")
                return
            if frame is None:
                return
            self.busy = True
            try:
                keep = await self._one(*frame)
            finally:
                self.busy, self.idle_since = False, time.monotonic()
            if not keep:
                return
            if loop.time() >= turn_ends:  # requests read ahead and answered inline never
                await asyncio.sleep(0)    # wait: let the loop serve everyone else
                turn_ends = loop.time() + TURN_S

    async def _one(self, header: dict, payload_bytes: int) -> bool:
        """Serve one request; False when the connection must end."""
        op = header.get("op")
        if op == "release":
            self.release_borrow(header.get("borrow"))
            self.payload_left = payload_bytes
            if payload_bytes:
                return await self._drain_or_fatal()
            return True
        route = _ROUTES.get(op, "shm_unknown") if op.__class__ is str else "shm_unknown"
        limits, state = self.state.limits, self.state
        t0, status, keep = time.perf_counter(), 200, True
        state.active += 1
        state.in_flight.inc()
        self.payload_left = payload_bytes
        try:
            if payload_bytes > limits.max_body_bytes:
                status = 413
                await self._fatal(413, f"payload of {payload_bytes} bytes exceeds "
                                       f"{limits.max_body_bytes}")
                return False
            status, keep = await self._dispatch(op, header)
            return keep
        finally:
            state.active -= 1
            state.in_flight.dec()
            m = self.server.route_metrics.get((route, status))
            if m is None:
                m = self.server.route_metrics[(route, status)] = (
                    state.requests.labels(route, str(status)), state.latency.labels(route))
            m[0].inc()
            m[1].observe(time.perf_counter() - t0)

    async def _dispatch(self, op: Any, header: dict) -> tuple[int, bool]:
        """Run ``op``; ``(status, keep the connection)``. Handlers send their own replies
        when they return None."""
        limits = self.state.limits
        try:
            if not self.state.ready:
                raise ProtocolError("server is draining (shutting down); retry elsewhere or "
                                    "later", 503)
            handler = shm_ops.HANDLERS.get(op) if isinstance(op, str) else None
            if op == "hello":
                raise ProtocolError("hello is the connection's first request only")
            if handler is None:
                raise ProtocolError(f"unknown op {op!r}; ops: {', '.join(S.OPS)}", 404)
            now = shm_ops.INLINE.get(op)
            out = now(self, header) if now is not None and not self.payload_left else None
            if out is not None:  # answered without waiting: no timeout to arm
                await self.reply(out)
                return 200, True
            async with asyncio.timeout(limits.request_timeout_s):
                out = await handler(self, header)
                if self.payload_left:
                    raise ProtocolError(f"{self.payload_left} payload bytes beyond what "
                                        f"{op} reads")
            if out is not None:
                await self.reply(out)
            return 200, True
        except (ProtocolError, Forbidden) as e:
            status = e.status if isinstance(e, ProtocolError) else 403
            message = str(e)
        except TimeoutError:
            await self._fatal(504, f"request exceeded {limits.request_timeout_s} s")
            return 504, False
        except (ConnectionError, asyncio.IncompleteReadError):
            raise
        except Exception as e:  # noqa: BLE001 - the server stays up; the error goes to the client
            log.exception("internal error on shm op %r", op)
            status, message = 500, f"internal error: {type(e).__name__}: {e}"
        if not await self._drain_or_fatal():
            return 504, False
        try:
            await self.reply(S.error_reply(status, message))
        except TimeoutError:
            await self._fatal(504, f"reply not read within {limits.request_timeout_s} s")
            return 504, False
        return status, True

    async def _drain_or_fatal(self) -> bool:
        """Drop the request's unread payload within the request timeout; False (after a 504,
        the connection ending) when it does not arrive in time."""
        timeout_s = self.state.limits.request_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await self.drain_payload()
        except TimeoutError:
            await self._fatal(504, f"payload not sent within {timeout_s} s "
                                   f"({self.payload_left} bytes short)")
            return False
        return True

    async def refuse(self, reply: dict, linger_s: float = 1.0) -> None:
        """Answer a peer that may not be served, then close after it has sent its hello (up
        to ``linger_s`` and 64 KiB, read and dropped), so that the hello does not fail with
        EPIPE before the client could read why."""
        await self.reply(reply)
        self.sock.shutdown(socket.SHUT_WR)
        scratch, left = memoryview(bytearray(4096)), 64 << 10
        try:
            async with asyncio.timeout(linger_s):
                while left > 0 and (n := await self.loop.sock_recv_into(self.sock, scratch)):
                    left -= n
        except TimeoutError:
            pass

    async def _fatal(self, status: int, message: str) -> None:
        """Answer an error after which the stream cannot go on (unless a reply is stuck
        already: the client reads nothing), and mark the connection to end: at once when
        nothing is borrowed, else once the client closes its end (``wait_for_close``: it may
        still be copying borrowed pages)."""
        self.reader.unwatch()  # (the reads of ``wait_for_close`` are the loop's own)
        if not self.send_stuck:
            try:
                await self.reply(S.error_reply(status, message))
            except (OSError, TimeoutError):
                pass
        self.linger = bool(self.borrows)

    async def wait_for_close(self) -> None:
        """After a fatal error with borrows held: stop sending, then read and drop whatever
        the client sends until it closes (its borrows are released by ``close`` then)."""
        self.reader.unwatch()
        try:
            self.sock.shutdown(socket.SHUT_WR)
            scratch = memoryview(bytearray(64 << 10))
            while await self.loop.sock_recv_into(self.sock, scratch):
                pass
        except OSError:
            pass


#: op -> its route label in the server's metrics
_ROUTES = {op: f"shm_{op}" for op in S.OPS}


def _fd_bytes(fds: list[int]) -> bytes:
    return array.array("i", fds).tobytes()


__all__ = ["Connection", "MAX_BORROWS", "SOCKET_BUFFER_BYTES"]
