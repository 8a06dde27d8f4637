"""Errors of a store reached across a process boundary, shared by the store core (the layered
store, the circuit breaker) and the daemon client that raises them."""
from __future__ import annotations


class StoreUnavailable(TimeoutError):
    """The daemon did not answer within the call's deadline (dead, hung or restarting)."""


class RemoteError(RuntimeError):
    """The daemon answered with an error status (4xx/5xx) and a JSON message.

    Attributes:
        status: HTTP status code.
        message: the server's error text.
    """

    def __init__(self, status: int, message: str):
        super().__init__(f"kvstore server error {status}: {message}")
        self.status = status
        self.message = message


class NotADaemon(RemoteError):
    """Something answered at the daemon's URL, but not a kvstore daemon: an answer without the
    daemon's protocol header (``X-KVStore-Protocol``), other than a gateway's 502/503/504, e.g.
    another web server's 404 or 501 page, or an engine's port given for the daemon's. Not retried; the message names the
    URL, the route, the status and the content type.
    """

    def __init__(self, status: int, message: str):
        super().__init__(status, message)
        self.args = (message,)

    def __str__(self) -> str:
        return self.message
