"""The daemon's same-host front: a Unix-socket server on the daemon's event loop, handing out
the shared CPU arena (wire format and op table: ``kvstore.daemon.shm_protocol``).

Lifetime of one connection::

    accept ─► SO_PEERCRED uid check ─► hello (token; reply carries the arena's fd) ─►
    requests, one at a time (``kvstore.daemon.shm_session``; ops: ``kvstore.daemon.shm_ops``)
    ─► end: every borrow released

* The socket file is created mode 0600 before ``listen`` (no connection can arrive earlier); a
  socket file left by a dead daemon is removed at start, one that still answers is refused;
  the file is unlinked at stop.
* Peers must run as the daemon's effective uid or as root (403 otherwise, then closed).
* Connections count against the HTTP server's connection cap too (``ConnectionGuard``: one
  cap for both paths, so that together they stay within the descriptors it leaves): one that
  finds it reached closes an idle connection of either path, or is answered 503 when every
  one is busy; an HTTP connection arriving at the cap may close an idle same-host one
  (``Connection.idle``: greeted, no request in flight or begun, no borrow held), longest idle
  first, as it would an idle HTTP one (rule: ``kvstore.daemon.conns``). Its client's next call
  finds the connection closed before sending and opens another (``ShmConnPool._take``). Each
  such close is counted (``kvstore_server_connections_closed_total{reason=
  "idle_evicted_same_host"}``) and logged at INFO at most once per ``ACCEPT_LOG_INTERVAL_S``.
  At most ``MAX_LINGERING_REFUSALS`` refused connections wait for their hello at
  once (a flood of connections is closed at once instead of holding descriptors), and a
  failing ``accept()`` (EMFILE) is logged at most once per ``ACCEPT_LOG_INTERVAL_S``.
* Requests run under the server's limits (``ServerLimits``: batch keys, body bytes, request
  timeout, payload budget), count in the server's request metrics with ``shm_<op>`` routes and
  in its ``active`` requests (so a SIGTERM drain waits for them); while draining every op but
  ``release`` is answered 503.
* Borrows (reader pins of gets) belong to the connection: ``release`` drops one, the
  connection's end drops the rest. The daemon never drops a borrow on its own while the
  client may still copy from it: after a fatal error (malformed frame, timeout) it answers,
  then waits for the client to close before releasing.
* Requests are read ahead by the connection's ``SocketReader`` (``kvstore.daemon.shm_reader``:
  one ``recvmsg`` for a frame's preamble, header and what follows); replies go out with
  ``send`` / ``loop.sock_sendall`` on the raw non-blocking socket. A put's bytes land straight
  in reserved arena pages: read by the daemon from the client's memory (``shm_vm``), copied
  from its staging area (``shm_staging``), or received from the socket (one copy, kernel to
  arena).
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import stat

from kvstore.api import KVStoreBase
from kvstore.daemon import shm_protocol as S
from kvstore.daemon.conns import ACCEPT_LOG_INTERVAL_S
from kvstore.daemon.shm_session import Connection
from kvstore.daemon.state import STATE_KEY, STORE_KEY, _ServerState
from kvstore.store import ChunkStore

log = logging.getLogger("kvstore.daemon.shm_server")

#: Longest path a Unix socket can bind (``sun_path`` minus its terminating NUL).
MAX_SOCKET_PATH_BYTES = 107
#: Refused connections that may wait (1 s) for their hello at once; more close at once.
MAX_LINGERING_REFUSALS = 32


class ShmServer:
    """Serve the same-host path of an app made by ``kvstore.daemon.server.create_app``.

    Args:
        app: the aiohttp app (its store, limits, metrics and thread pool are shared).
        path: the socket file's path.
        max_connections: the daemon's ``--max-connections``, named in the 503 of a connection
            refused at the cap; the cap itself is the app's ``ConnectionGuard``'s (the same
            value: ``kvstore.daemon.run``), one for both paths. 0: no cap.

    ``start`` and ``stop`` run on the app's event loop. The store should have a shared arena
    (``ChunkStore.shared_arena``); without one ``hello`` announces ``arena_bytes`` 0 and every
    get answers its chunks inline.
    """

    def __init__(self, app, path: str, max_connections: int = 0) -> None:
        self.store: KVStoreBase = app[STORE_KEY]
        self.state: _ServerState = app[STATE_KEY]
        self.path = os.path.abspath(path)
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(f"unix socket path {self.path!r} is longer than "
                             f"{MAX_SOCKET_PATH_BYTES} bytes")
        #: lookups may run on the event loop (``try_lookup_keys``); declared once per store
        self.nonblocking_lookup = bool(self.store.capabilities.nonblocking_lookup)
        arena = self.store.shared_arena() if isinstance(self.store, ChunkStore) else None
        self.arena_fd, self.arena_bytes, self.page_bytes = arena or (None, 0, 0)
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()
        #: greeted connections (the ones the cap may close when idle) and their tasks
        self._greeted: dict[Connection, asyncio.Task] = {}
        self._last_evict_log, self._unlogged_evictions = -float("inf"), 0
        #: open connections beyond this many are answered 503 and closed (0: no cap)
        self.max_connections = max_connections
        #: (route, status) -> the request counter's and latency histogram's labelled children
        self.route_metrics: dict[tuple[str, int], tuple] = {}
        self._lingering = 0  # refused connections waiting for their hello
        self._last_accept_log, self._unlogged_accept_errors = -float("inf"), 0

    @property
    def url(self) -> str:
        return f"unix://{self.path}"

    async def start(self) -> None:
        """Listen on ``path`` (mode 0600).

        Raises:
            ValueError: another process answers on ``path``, it is not a socket, or it cannot
                be bound (naming the path).
        """
        _remove_stale(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o600)  # before listen: nobody could connect yet
            sock.listen(128)
        except OSError as e:
            sock.close()
            raise ValueError(f"cannot listen on unix socket {self.path}: {e}") from None
        sock.setblocking(False)
        self._sock = sock
        self.state.unix_socket = self.path
        self.state.conns.others = self._conns.__len__  # one connection cap for both paths
        self.state.conns.other_idle = self._longest_idle
        self._accepting = asyncio.ensure_future(self._accept_loop())
        log.info("same-host path on %s (arena %d bytes)", self.url, self.arena_bytes)

    def stop_accepting(self) -> None:
        """Close the listening socket and unlink its file (open connections go on)."""
        self.state.conns.others = lambda: 0
        self.state.conns.other_idle = lambda: None
        if self._accepting is not None:
            self._accepting.cancel()
            self._accepting = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.state.unix_socket = None

    async def stop(self) -> None:
        """Stop accepting, end every connection (their borrows are released). Idempotent."""
        self.stop_accepting()
        tasks = list(self._conns)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except asyncio.CancelledError:
                raise
            except OSError as e:  # EMFILE and friends: back off instead of spinning
                self._accept_failed(e)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.ensure_future(self._serve_conn(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    def _longest_idle(self):
        """The greeted connection idle longest that may be closed (``Connection.idle``) as
        ``(idle since, a function closing it)``, or None (``ConnectionGuard.other_idle``)."""
        cands = [c for c in self._greeted if not (c.busy or c.borrows)]
        for c in sorted(cands, key=lambda c: c.idle_since):
            if c.idle():
                return c.idle_since, lambda: self._close_idle(c)
        return None

    def _close_idle(self, c: Connection) -> None:
        """Close idle connection ``c`` now to make room at the cap (uncounted at once)."""
        task = self._greeted.pop(c, None)
        self._conns.discard(task)
        c.close()  # no borrow held: nothing to wait for
        if task is not None:
            task.cancel()
        now = asyncio.get_running_loop().time()
        self._unlogged_evictions += 1
        if now - self._last_evict_log >= ACCEPT_LOG_INTERVAL_S:
            log.info("closed %d idle same-host connection(s) to make room at the connection "
                     "cap of %d (HTTP and same-host together; the clients reconnect on their "
                     "next call)", self._unlogged_evictions, self.state.conns.max_connections)
            self._last_evict_log, self._unlogged_evictions = now, 0

    def _accept_failed(self, e: OSError) -> None:
        """Count a failed ``accept()`` (the HTTP server's ``accept_errors``) and log it, at
        most once per ``ACCEPT_LOG_INTERVAL_S`` with the count since the last line."""
        self.state.conns.accept_errors.inc()
        now = asyncio.get_running_loop().time()
        if now - self._last_accept_log < ACCEPT_LOG_INTERVAL_S:
            self._unlogged_accept_errors += 1
            return
        log.warning("unix socket accept failed: %s (%d more since the last report; open "
                    "connections %d here, %d HTTP)", e, self._unlogged_accept_errors,
                    len(self._conns), self.state.conns.open)
        self._last_accept_log, self._unlogged_accept_errors = now, 0

    async def _refuse(self, c: Connection, reply: dict) -> None:
        """``c.refuse`` with its wait for the hello while few refusals wait, else at once."""
        if self._lingering >= MAX_LINGERING_REFUSALS:
            await c.refuse(reply, linger_s=0)
            return
        self._lingering += 1
        try:
            await c.refuse(reply)
        finally:
            self._lingering -= 1

    async def _serve_conn(self, sock: socket.socket) -> None:
        c = Connection(self, sock)
        try:
            uid = S.peer_uid(sock)
            if uid not in (os.geteuid(), 0):
                await self._refuse(c, S.error_reply(403, f"uid {uid} may not use this socket"))
                return
            if not self.state.conns.make_room():
                cap = self.max_connections or self.state.conns.max_connections
                log.debug("unix socket at the connection cap of %d", cap)
                await self._refuse(c, S.error_reply(503, f"too many connections (cap {cap}, "
                                                         "HTTP and same-host together); "
                                                         "retry later"))
                return
            if await c.hello():
                self._greeted[c] = asyncio.current_task()  # type: ignore[assignment]
                await c.serve()
        except (ConnectionError, OSError) as e:
            log.debug("shm connection ended: %r", e)
        finally:
            self._greeted.pop(c, None)
            c.close()


def _remove_stale(path: str) -> None:
    """Remove a socket file at ``path`` that no process answers on.

    Raises:
        ValueError: ``path`` exists and is not a socket, or a process accepts on it.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ValueError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError as e:
        if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise ValueError(f"cannot tell whether {path} is in use: {e}") from None
        os.unlink(path)
        log.info("removed stale unix socket %s", path)
        return
    finally:
        probe.close()
    raise ValueError(f"another process is listening on {path}")


__all__ = ["ShmServer", "MAX_SOCKET_PATH_BYTES"]
