"""The connection pool of the same-host client (``kvstore.daemon.shm_client``): ``ShmConnPool``
takes a pooled connection (or opens and greets a new one, learning the daemon's limits from its
``hello``), runs one exchange on it within the call's deadline, with the retries the client's
module docstring describes, and gives it back.

A call that is not idempotent (``pin``, ``unpin``: one request each) is retried after it was
sent only when the daemon cannot have read the whole request (``never_read``): the send
failed (``EPIPE`` / ``ECONNRESET``: the daemon had closed the connection), or the daemon
closed it with bytes of ours unread (a Unix stream socket closed with data in its receive
queue gives its peer ``ECONNRESET`` instead of end-of-file) before any reply byte arrived.
That is the daemon closing an idle pooled connection to make room at its connection cap
(``kvstore.daemon.conns``) just as the call is sent: it closes only a connection with nothing
unread, so a request it had read is never lost that way, and one it had not read is not done.
"""
from __future__ import annotations

import re
import threading
import time
from typing import Any, Callable

from kvstore.daemon import protocol as P
from kvstore.daemon.batches import DaemonLimits
from kvstore.daemon.shm_conn import Conn
from kvstore.daemon.shm_errors import SocketGone
from kvstore.daemon.transport import check_timeout
from kvstore.errors import RemoteError, StoreUnavailable

#: Errors of a connection that broke (the call may be retried on a fresh one when idempotent)
BROKEN = (ConnectionError, EOFError, OSError)


def never_read(conn: Conn, error: BaseException) -> bool:
    """Whether the daemon cannot have read all of the one request just sent on ``conn``,
    which failed with ``error``: ``EPIPE`` or ``ECONNRESET`` (at the send, or at the reply: a
    Unix socket closed with bytes of ours unread) with no reply byte received. The request's
    frame is the last thing sent, so some of it was unread, and the daemon acts on a
    request only once it read the whole frame."""
    return (isinstance(error, (BrokenPipeError, ConnectionResetError))
            and conn._rend == conn._rpos)  # (no reply byte: was empty when taken, alive())


class ShmConnPool:
    """Pooled connections to the daemon's socket (a base of ``ShmKVStoreClient``, which sets
    the attributes used here: ``path``, ``url``, ``timeout_s``, ``pool_size``,
    ``retry_backoff_s``, ``refused_tries``, ``refused_backoff_s``, ``vm_put``, ``_token``,
    ``_lock``, ``_idle``, ``_version``, ``_arenas``, ``_releases``, ``_closed``, ``limits``).
    Thread-safe: each call takes a connection of its own."""

    path: str
    url: str
    limits: DaemonLimits | None
    _lock: threading.Lock
    _idle: list

    def _take(self, deadline: float) -> Conn:
        """An idle connection the daemon has not closed, else a new one."""
        while True:
            with self._lock:
                if self._closed:
                    raise RuntimeError("ShmKVStoreClient is closed")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect(deadline)
            if conn.alive():
                return conn
            conn.close()

    def _connect(self, deadline: float) -> Conn:
        """A new connection; hello in this client's protocol version, else (an older daemon
        answers 400 with the versions it serves) in the highest of those from then on."""
        try:
            conn = Conn(self.path, self._token, deadline, self._arenas, self._version,
                        self.vm_put)
        except RemoteError as e:
            if (e.status != 400 or self._version == 1
                    or "unsupported shm protocol version" not in str(e)):
                raise
            served = [int(v) for v in re.findall(r"\d+", str(e).rpartition("supported:")[2])]
            self._version = max([v for v in served if v < self._version] or [1])
            conn = Conn(self.path, self._token, deadline, self._arenas, self._version,
                        self.vm_put)
        self.limits = conn.hello.limits or self.limits  # (batches.run_batches reads them)
        return conn

    def _give(self, conn: Conn) -> None:
        with self._lock:
            kept = not self._closed and len(self._idle) < self.pool_size
            if kept:
                self._idle.append(conn)
        if not kept:
            conn.close()  # the daemon drops its pins, deferred releases included
        elif conn.has_pending:
            self._releases.note(conn)

    def _take_idle(self, conn: Conn) -> bool:
        """Remove ``conn`` from the idle pool if it is there (for the release flusher)."""
        with self._lock:
            if conn in self._idle:
                self._idle.remove(conn)
                return True
        return False

    def _call(self, what: str, fn: Callable[[Conn, float], Any], *, idempotent: bool,
              timeout_s: float | None, hold: bool = False) -> Any:
        """Run ``fn(conn, deadline)`` on a pooled connection with the deadline and retries
        of the module docstring. ``hold``: a result of ``fn`` owns the connection (it gives
        it back itself); an error still returns or closes it here."""
        timeout = self.timeout_s if timeout_s is None else check_timeout(timeout_s)
        deadline = time.monotonic() + timeout
        attempt, refused, last, sent = 0, 0, None, False
        while True:
            if time.monotonic() >= deadline:
                raise StoreUnavailable(f"{what} {self.url}: no answer within {timeout} s "
                                       f"(last error: {last!r})")
            try:
                conn = self._take(deadline)
            except (FileNotFoundError, ConnectionRefusedError) as e:
                refused, last = refused + 1, e
                if self.refused_tries is not None and refused >= self.refused_tries:
                    why = ("no such socket file" if isinstance(e, FileNotFoundError)
                           else "connection refused")
                    raise SocketGone(f"{what} {self.url}: {why} ({refused} tries); is the "
                                     "kvstore daemon running?", sent=sent,
                                     idempotent=idempotent) from None
                time.sleep(max(0.0, min(self.refused_backoff_s, deadline - time.monotonic())))
                continue
            except TimeoutError:
                raise StoreUnavailable(f"{what} {self.url}: no answer within {timeout} s "
                                       "(connecting)") from None
            except RemoteError as e:
                if e.status != 503 or not idempotent:
                    raise
                last = e
            except P.ProtocolError as e:
                raise RemoteError(502, f"malformed hello reply: {e}") from None
            except BROKEN as e:
                last = e
            else:
                before, sent = sent, True
                try:
                    out = fn(conn, deadline)
                except RemoteError as e:
                    self._give(conn)  # the reply was read whole: the connection is fine
                    if e.status != 503 or not idempotent:
                        raise
                    last = e
                except TimeoutError:
                    conn.close()
                    raise StoreUnavailable(f"{what} {self.url}: no answer within {timeout} s"
                                           ) from None
                except P.ProtocolError as e:
                    conn.close()
                    raise RemoteError(502, f"malformed {what} reply: {e}") from None
                except BROKEN as e:
                    unread = not idempotent and never_read(conn, e)
                    conn.close()
                    if unread:
                        sent = before  # (the daemon did nothing of it: as if not sent)
                    elif not idempotent:
                        raise StoreUnavailable(f"{what} {self.url} failed after sending; not "
                                               f"retried (not idempotent): {e!r}") from e
                    last = e
                except BaseException:
                    conn.close()
                    raise
                else:
                    if not hold:
                        self._give(conn)
                    return out
            delay = min(self.retry_backoff_s * 2 ** attempt, 0.5, deadline - time.monotonic())
            attempt += 1
            if delay > 0:
                time.sleep(delay)
