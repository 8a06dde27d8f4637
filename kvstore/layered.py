"""``LayeredStore``: in-process tiers in front of a remote daemon, as one ``KVStoreBase``.

Reads try the local store first and fetch only its misses from the remote one (and copy what
came back into the local store); writes go to both (write-through, so other engines sharing the
daemon see them). The remote store failing (dead daemon, timeout) never fails a local read or
write: the remote part is counted as an error and skipped, logged once per operation and cause
(``kvstore.cause_log.CauseLog``: the error's class, HTTP status and message without numbers, so
a daemon that first refuses connections and later answers 400 logs both), again when a cause
comes back after the operation worked (at most once per 30 s per operation), and one INFO line
says when it works again. Operations on a namespace are told apart by its chunk size too: a
daemon whose tier refuses the full chunks (400) but stores the smaller tail pieces logs the
refusal once, not after every piece stored.

Read-only remote (``remote_read_only``, a daemon token with the ``reader`` role): saves,
demotions, removals and clears stay in the local store and nothing is sent to the daemon (it
would refuse each with 403); lookups and gets ask it as usual.

Hit tiers: local tier names (``"cpu"``, ``"disk"``...) then ``"remote:<daemon tier>"``.

``CircuitBreakerStore`` (``kvstore.circuit_store``, re-exported here) wraps the remote store so
a dead daemon costs ~nothing per request: after a call fails with an unavailability error,
remote calls are skipped (``RemoteSkipped``, at once) for a cool-down (2 s, doubling per
consecutive failure up to 30 s); then one call probes.
"""
from __future__ import annotations

import logging
import threading
from typing import Sequence

import torch

from kvstore.api import KVStoreBase, LookupResult, StoreCapabilities
from kvstore.cause_log import CauseLog
from kvstore.circuit_store import (CircuitBreakerStore, RemoteSkipped,  # noqa: F401
                                   _is_unavailable)
from kvstore.keys import ChunkKey, Namespace

log = logging.getLogger("kvstore.layered")


def remote_breaker(store: KVStoreBase) -> CircuitBreakerStore | None:
    """The ``CircuitBreakerStore`` of ``store``: itself, or a ``LayeredStore``'s remote."""
    if isinstance(store, CircuitBreakerStore):
        return store
    remote = store.remote if isinstance(store, LayeredStore) else None
    return remote if isinstance(remote, CircuitBreakerStore) else None


class LayeredStore(KVStoreBase):
    """Local ``KVStoreBase`` (usually ``ChunkStore``) in front of a remote one (``KVStoreClient``).

    Args:
        local: the in-process store.
        remote: the remote store.
        remote_read_only: True: ``remote`` may only be read (a daemon token with the
            ``reader`` role): puts, demotions, removals and clears go to ``local`` only;
            one INFO line says so here.

    Attributes:
        remote_errors: remote calls that raised (each also skipped); calls a
            ``CircuitBreakerStore`` remote skipped (``RemoteSkipped``) are counted there.
        remote_read_only: as the argument.
        causes: the remote failures' warnings (``CauseLog``; its ``relog_interval_s``).
    """

    def __init__(self, local: KVStoreBase, remote: KVStoreBase, *,
                 remote_read_only: bool = False):
        self.local, self.remote = local, remote
        self.remote_errors = 0
        self.remote_read_only = remote_read_only
        self.url = getattr(remote, "url", None)   # (for messages only)
        url = str(self.url).replace("%", "%%")
        self.causes = CauseLog(log, f"remote store {url} %s works again (%d failures since it "
                                    f"last worked)")
        self._lock = threading.Lock()
        if remote_read_only:
            log.info("remote store %s is read-only for this engine (role reader): saves stay "
                     "in the local tiers, nothing is sent to it; lookups and loads still ask "
                     "it", self.url)

    @staticmethod
    def _kind(what: str, ns: Namespace | None) -> str:
        return what if ns is None else f"{what} of {ns.layout.chunk_size}-token chunks"

    def _remote_failed(self, what: str, exc: BaseException, ns: Namespace | None = None) -> None:
        """Count a failed remote call and log it once per cause (module docstring)."""
        kind = self._kind(what, ns)
        if isinstance(exc, RemoteSkipped):  # not sent; the breaker counts it and logged why
            self.causes.failed(kind)
            return
        with self._lock:
            self.remote_errors += 1
        self.causes.warn(kind, "remote store %s %s failed (%s: %s); serving from local tiers "
                         "only", self.url, kind, type(exc).__name__, exc, cause=exc)

    def _remote_ok(self, what: str, ns: Namespace | None = None) -> None:
        """A remote call worked: its failures' causes may be logged again (``CauseLog``)."""
        self.causes.recovered(self._kind(what, ns))

    def lookup_keys(self, ns: Namespace, keys: Sequence[ChunkKey]) -> LookupResult:
        loc = self.local.lookup_keys(ns, keys)
        tiers = list(loc.tiers)
        n = loc.num_hit_chunks
        if n < len(keys):
            try:
                rem = self.remote.lookup_keys(ns, keys[n:])
                tiers += [f"remote:{t}" for t in rem.tiers[:rem.num_hit_chunks]]
                self._remote_ok("lookup", ns)
            except Exception as exc:  # noqa: BLE001 - remote trouble means a local-only answer
                self._remote_failed("lookup", exc, ns)
        return LookupResult(len(tiers), ns.layout.chunk_size, tuple(tiers), len(keys))

    @property
    def capabilities(self) -> StoreCapabilities:
        """Remote when either part is (a local miss waits for the remote store);
        ``get_chunks`` takes ``parents`` (it copies remote hits into the local store); pins
        are the local store's; tiers: the local ones, then ``"remote"`` (lookups name remote
        hits ``"remote:<daemon tier>"``). Direct I/O and durable puts are not offered (they
        would bypass the remote store)."""
        loc, rem = self.local.capabilities, self.remote.capabilities
        return StoreCapabilities(remote=loc.remote or rem.remote, pins=loc.pins,
                                 get_takes_parents=True, tiers=loc.tiers + ("remote",))

    def get_chunks(self, ns: Namespace, keys: Sequence[ChunkKey],
                   parents: Sequence[ChunkKey | None] | None = None) -> list[torch.Tensor | None]:
        """Local chunks, then the local misses from the remote store; those are copied into
        the local store with their parents: ``parents`` (as ``put_chunks`` takes them), or,
        when None, key i-1 for key i (the keys taken as consecutive chunks of one prompt) and
        ``keys[0]``, whose parent is unknown then, not copied (a copy with a wrong parent
        could outlive its prefix)."""
        out = list(self.local.get_chunks(ns, keys))
        miss = [i for i, kv in enumerate(out) if kv is None]
        if miss:
            try:
                got = self.remote.get_chunks(ns, [keys[i] for i in miss])
            except Exception as exc:  # noqa: BLE001
                self._remote_failed("get", exc, ns)
                return out
            self._remote_ok("get", ns)
            fetched_keys, fetched, fetched_parents = [], [], []
            for i, kv in zip(miss, got):
                out[i] = kv
                if kv is not None and (parents is not None or i > 0):
                    fetched_keys.append(keys[i])
                    fetched.append(kv)
                    fetched_parents.append(parents[i] if parents is not None else keys[i - 1])
            if fetched:
                self.local.put_chunks(ns, fetched_keys, fetched, fetched_parents)
        return out

    def put_chunks(self, ns: Namespace, keys: Sequence[ChunkKey],
                   kvs: Sequence[torch.Tensor],
                   parents: Sequence[ChunkKey | None] | None = None) -> int:
        """Put into the local store, then into the remote one (unless ``remote_read_only``;
        a remote failure is counted and skipped); returns the larger count.

        Raises:
            ValueError: bad input (as the stores raise it).
        """
        args = (ns, keys, kvs) if parents is None else (ns, keys, kvs, parents)
        n = self.local.put_chunks(*args)
        if self.remote_read_only:
            return n
        try:
            n = max(n, self.remote.put_chunks(*args))
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001
            self._remote_failed("put", exc, ns)
        else:
            self._remote_ok("put", ns)
        return n

    def exists(self, ns: Namespace, keys: Sequence[ChunkKey]) -> list[bool]:
        loc = self.local.exists(ns, keys)
        if all(loc):
            return loc
        try:
            rem = self.remote.exists(ns, keys)
        except Exception as exc:  # noqa: BLE001
            self._remote_failed("exists", exc, ns)
            return loc
        self._remote_ok("exists", ns)
        return [a or b for a, b in zip(loc, rem)]

    def remove(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        n = self.local.remove(ns, keys)
        if self.remote_read_only:
            return n
        try:
            n = max(n, self.remote.remove(ns, keys))
        except Exception as exc:  # noqa: BLE001
            self._remote_failed("remove", exc, ns)
        else:
            self._remote_ok("remove", ns)
        return n

    def demote(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Demote in the local store and in the remote one (a remote failure is counted and
        skipped; not with ``remote_read_only``); returns the larger count."""
        n = self.local.demote(ns, keys)
        if self.remote_read_only:
            return n
        try:
            n = max(n, self.remote.demote(ns, keys))
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001
            self._remote_failed("demote", exc, ns)
        else:
            self._remote_ok("demote", ns)
        return n

    def clear(self, ns: Namespace | None = None) -> int:
        n = self.local.clear(ns)
        if self.remote_read_only:
            return n
        try:
            n = max(n, self.remote.clear(ns))
        except Exception as exc:  # noqa: BLE001
            self._remote_failed("clear", exc)
        else:
            self._remote_ok("clear")
        return n

    def pin(self, ns: Namespace, keys: Sequence[ChunkKey], lease_s: float | None = None) -> int:
        return self.local.pin(ns, keys, lease_s)

    def unpin(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        return self.local.unpin(ns, keys)

    def stats(self) -> dict:
        out = {"local": self.local.stats(), "remote_errors": self.remote_errors}
        try:
            out["remote"] = self.remote.stats()
        except Exception as exc:  # noqa: BLE001
            self._remote_failed("stats", exc)
        else:
            self._remote_ok("stats")
        return out

    def close(self) -> None:
        try:
            self.local.close()
        finally:
            self.remote.close()
