"""The same-host client's typed failure for a socket that is gone: ``SocketGone``, raised by
``kvstore.daemon.shm_client.ShmKVStoreClient`` when the daemon's socket file is absent or
refuses connections, saying whether the call reached the daemon before, so that
``kvstore.daemon.client.KVStoreClient`` knows whether it may make the call again on the path
the daemon offers now (its HTTP URL or another socket) without reading the message."""
from __future__ import annotations

from kvstore.errors import StoreUnavailable


class SocketGone(StoreUnavailable):
    """The daemon's Unix socket has no file or refuses connections (``refused_tries``
    attempts in a row): the daemon is down, restarted without it or on another path.

    Attributes:
        sent: whether an earlier attempt of the same call was sent to the daemon (only an
            idempotent call is attempted again after it was sent: a non-idempotent one that
            fails after sending raises a plain ``StoreUnavailable`` at once).
        idempotent: whether the call may take effect twice without harm (lookup, exists,
            get, put of content-addressed chunks, remove, demote, clear, stats; not pin or
            unpin).
    """

    def __init__(self, message: str, *, sent: bool, idempotent: bool):
        super().__init__(message)
        self.sent, self.idempotent = bool(sent), bool(idempotent)

    @property
    def resendable(self) -> bool:
        """Whether making the call again elsewhere cannot apply it twice: nothing was sent,
        or the call is idempotent."""
        return not self.sent or self.idempotent
