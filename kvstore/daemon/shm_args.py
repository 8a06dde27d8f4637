"""What every op of the daemon's same-host path reads from its request header first: the
namespace and the keys, checked against the caller's tenant and the store
(``kvstore.daemon.shm_ops``, ``kvstore.daemon.shm_get``), and the shape of an ``ok`` reply."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.daemon import protocol as P
from kvstore.daemon import shm_protocol as S
from kvstore.daemon.state import _check_fits
from kvstore.daemon.tenants import READ

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.daemon.shm_server import Connection


def ns_keys(c: "Connection", h: dict, access: str = READ):
    """``(namespace, keys)`` of a request (its ``hashes``, else its ``keys``), once the caller
    may use the namespace for ``access`` (403) and it fits the store (400); more than
    ``max_batch_keys`` keys: 413.

    Raises:
        ProtocolError: a malformed namespace or key list (400), too many keys (413).
        Forbidden: the tenant may not use the namespace for ``access``.
    """
    ns = P.parse_namespace(h.get("namespace"))
    c.tenant.check(ns.cache_salt, access)
    _check_fits(c.store, ns, c.state)
    hashes = h.get("hashes")
    if hashes is not None:
        return ns, S.parse_hashes(ns, hashes, c.state.limits.max_batch_keys)
    return ns, P.parse_keys(ns, h.get("keys"), c.state.limits.max_batch_keys)


def ok(**fields: Any) -> dict:
    """An ``ok`` reply's header fields."""
    return {"ok": True, **fields}


__all__ = ["ns_keys", "ok"]
