"""``LayeredStore``: in-process tiers in front of a remote daemon, as one ``KVStoreBase``.

Reads try the local store first and fetch only its misses from the remote one (and copy what
came back into the local store); writes go to both (write-through, so other engines sharing the
daemon see them). The remote store failing (dead daemon, timeout) never fails a local read or
write: the remote part is counted as an error and skipped, logged once.

Hit tiers: local tier names (``"cpu"``, ``"disk"``...) then ``"remote:<daemon tier>"``.
"""
from __future__ import annotations

import logging
import threading
from typing import Sequence

import torch

from kvstore.api import KVStoreBase, LookupResult
from kvstore.keys import ChunkKey, Namespace

log = logging.getLogger("connectors.layered_store")


class LayeredStore(KVStoreBase):
    """Local ``KVStoreBase`` (usually ``ChunkStore``) in front of a remote one (``KVStoreClient``).

    Args:
        local: the in-process store.
        remote: the remote store.

    Attributes:
        remote_errors: remote calls that raised (each also skipped).
    """

    def __init__(self, local: KVStoreBase, remote: KVStoreBase):
        self.local, self.remote = local, remote
        self.remote_errors = 0
        self._warned = False
        self._lock = threading.Lock()

    def _remote_failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.remote_errors += 1
            first, self._warned = not self._warned, True
        if first:
            log.warning("remote store %s failed (%s: %s); serving from local tiers only "
                        "(logged once)", what, type(exc).__name__, exc)

    def lookup_keys(self, ns: Namespace, keys: Sequence[ChunkKey]) -> LookupResult:
        loc = self.local.lookup_keys(ns, keys)
        tiers = list(loc.tiers)
        n = loc.num_hit_chunks
        if n < len(keys):
            try:
                rem = self.remote.lookup_keys(ns, keys[n:])
                tiers += [f"remote:{t}" for t in rem.tiers[:rem.num_hit_chunks]]
            except Exception as exc:  # noqa: BLE001 - remote trouble means a local-only answer
                self._remote_failed("lookup", exc)
        return LookupResult(len(tiers), ns.layout.chunk_size, tuple(tiers), len(keys))

    def get_chunks(self, ns: Namespace, keys: Sequence[ChunkKey]) -> list[torch.Tensor | None]:
        out = list(self.local.get_chunks(ns, keys))
        miss = [i for i, kv in enumerate(out) if kv is None]
        if miss:
            try:
                got = self.remote.get_chunks(ns, [keys[i] for i in miss])
            except Exception as exc:  # noqa: BLE001
                self._remote_failed("get", exc)
                return out
            fetched_keys, fetched = [], []
            for i, kv in zip(miss, got):
                out[i] = kv
                if kv is not None:
                    fetched_keys.append(keys[i])
                    fetched.append(kv)
            if fetched:
                self.local.put_chunks(ns, fetched_keys, fetched)
        return out

    def put_chunks(self, ns: Namespace, keys: Sequence[ChunkKey],
                   kvs: Sequence[torch.Tensor]) -> int:
        n = self.local.put_chunks(ns, keys, kvs)
        try:
            n = max(n, self.remote.put_chunks(ns, keys, kvs))
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001
            self._remote_failed("put", exc)
        return n

    def exists(self, ns: Namespace, keys: Sequence[ChunkKey]) -> list[bool]:
        loc = self.local.exists(ns, keys)
        if all(loc):
            return loc
        try:
            rem = self.remote.exists(ns, keys)
        except Exception as exc:  # noqa: BLE001
            self._remote_failed("exists", exc)
            return loc
        return [a or b for a, b in zip(loc, rem)]

    def remove(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        n = self.local.remove(ns, keys)
        try:
            n = max(n, self.remote.remove(ns, keys))
        except Exception as exc:  # noqa: BLE001
            self._remote_failed("remove", exc)
        return n

    def clear(self, ns: Namespace | None = None) -> int:
        n = self.local.clear(ns)
        try:
            n = max(n, self.remote.clear(ns))
        except Exception as exc:  # noqa: BLE001
            self._remote_failed("clear", exc)
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
        return out

    def close(self) -> None:
        try:
            self.local.close()
        finally:
            self.remote.close()
