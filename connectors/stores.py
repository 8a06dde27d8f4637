"""Store construction for every connector: one description of a store (``StoreSpec``), one
way to open it (``open_store``), and a refcounted registry (``StoreRegistry``) for engines whose
connector objects share one store (vLLM builds a scheduler-side and a worker-side connector in
one process).

Which store a ``StoreSpec`` opens:

* ``cpu_bytes`` and/or ``disk_path`` (+ ``disk_bytes``) only: an in-process ``ChunkStore``
  (``disk_path`` alone = disk tier of ``DEFAULT_DISK_BYTES``, no CPU tier);
* ``url`` only: the ``kvstore serve`` daemon through ``KVStoreClient``, wrapped in a
  ``CircuitBreakerStore`` when ``breaker`` is given;
* both: ``LayeredStore`` = the in-process tiers in front of the daemon.

``remote_url`` adds a remote tier (Redis, ``kvstore.tiers.remote``) below the in-process tiers,
shared by every store pointing at the same Redis; alone it comes with a CPU tier of
``DEFAULT_CPU_BYTES``. It is a tier of the in-process store, so it needs one: with only ``url``
(a daemon) it is refused; give the daemon ``kvstore serve --remote-url`` instead. Its password
comes from the URL or ``$KVSTORE_REMOTE_PASSWORD`` and never shows in ``repr``.

With a daemon and an ``auth_token``, the daemon is asked once for the token's tenant salt
(``GET /v1/whoami``, ``daemon_tenant_salt``); every namespace the connector names must carry
it (``kvstore.daemon.tenants.bind_salt``). A token whose role is ``reader`` may only read:
in front of in-process tiers the ``LayeredStore`` is read-only towards the daemon (saves stay
local); with the daemon alone the engine saves nothing (``engine_saves``).

Sizes accept ints or text (``"512MiB"``). ``url`` accepts ``http://HOST:PORT`` or
``tcp://HOST:PORT`` (the same daemon), or ``unix:///PATH`` (a daemon's ``--unix-socket`` on
this host; an ``http://`` daemon on this host that has one is switched to it by itself).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from kvstore.api import KVStoreBase
# the disk tier size when only disk_path is given (re-exported: factory and tests name it here)
from kvstore.defaults import DEFAULT_DISK_BYTES  # noqa: F401

log = logging.getLogger("kvstore.connectors.stores")

#: CPU tier size when only ``remote_url`` is given (``StoreConfig``'s default).
DEFAULT_CPU_BYTES = "1GiB"
#: Deadline of the one ``whoami`` call a daemon-backed connector makes at start (seconds).
WHOAMI_TIMEOUT_S = 2.0
#: Deadline of one background save to a daemon behind a breaker (seconds).
SAVE_TIMEOUT_S = 30.0
#: Extra deadline of a daemon load per chunk it reads (seconds).
GET_TIMEOUT_S_PER_CHUNK = 0.05


def http_url(url: str) -> str:
    """``url`` as the daemon client takes it (``tcp://`` becomes ``http://``; a same-host
    daemon's ``unix:///PATH`` is kept).

    Raises:
        ValueError: not ``http(s)://HOST:PORT`` / ``tcp://HOST:PORT`` / ``unix:///PATH``, a
            bad port, no host, a path (``/v1``), a relative socket path.
    """
    if url.startswith("unix://"):
        from kvstore.daemon.shm_conn import unix_path
        unix_path(url)
        return url
    if url.startswith("tcp://"):
        url = "http://" + url[len("tcp://"):]
    from kvstore.daemon.transport import check_url
    return check_url(url)


@dataclass(frozen=True)
class BreakerTimes:
    """Deadlines of a ``CircuitBreakerStore`` around the daemon client (seconds).

    Attributes:
        put_timeout_s: one background save.
        get_timeout_s_per_chunk, get_timeout_s_base: a load of ``n`` chunks may take
            ``base + n * per_chunk``.
    """

    put_timeout_s: float
    get_timeout_s_per_chunk: float
    get_timeout_s_base: float

    @classmethod
    def for_connector(cls, timeout_s: float,
                      per_chunk_s: float = GET_TIMEOUT_S_PER_CHUNK) -> "BreakerTimes":
        """The deadlines both connectors (engine_min's, vLLM's) give their daemon: a save
        ``SAVE_TIMEOUT_S`` (background work: a big save on a busy host must not time out and
        trip the breaker), a load of ``n`` chunks ``timeout_s + n * per_chunk_s``; lookups
        and pins keep the client's ``StoreSpec.timeout_s``.

        Raises:
            ValueError: ``timeout_s`` not > 0 or ``per_chunk_s`` negative.
        """
        if not timeout_s > 0 or not per_chunk_s >= 0:
            raise ValueError(f"breaker deadlines need timeout_s > 0 and per_chunk_s >= 0, got "
                             f"{timeout_s}, {per_chunk_s}")
        return cls(put_timeout_s=SAVE_TIMEOUT_S, get_timeout_s_per_chunk=per_chunk_s,
                   get_timeout_s_base=timeout_s)


@dataclass(frozen=True)
class StoreSpec:
    """A store to open (see module docstring). Frozen and hashable: the key of a
    ``StoreRegistry``.

    Attributes:
        cpu_bytes: in-process CPU tier bytes (None/0 = none).
        disk_path: in-process disk tier directory (lmdb; created if missing).
        disk_bytes: disk tier bytes (None/0 with ``disk_path`` = ``DEFAULT_DISK_BYTES``).
        url: daemon URL.
        auth_token: daemon bearer token.
        timeout_s: the daemon client's per-call timeout (seconds).
        breaker: wrap the daemon client in a ``CircuitBreakerStore`` with these deadlines;
            None = the bare client.
        name: tells apart in-process stores of equal sizes in one registry.
        remote_url: Redis of the in-process store's remote tier
            (``redis://[user:password@]host:port[,host:port...]``, ``rediss://``); None = none.
            A password in it moves to ``remote_password`` at construction.
        remote_key_prefix: deployment prefix of every Redis key.
        remote_ttl_s: seconds a value lives after its last write or read (0 = no expiry).
        remote_timeout_s: deadline of a remote lookup (seconds).
        remote_password: Redis password when the URL has none (else
            ``$KVSTORE_REMOTE_PASSWORD``); not in ``repr``.
        lossy_codec: ``"kivi"``, ``"int8"`` or ``"fp8"``: the in-process store's disk and remote
            tiers write with this codec the chunks of namespaces that accept it
            (``Namespace.lossy_codec``; every other chunk losslessly, as by default); ``""``
            (default): the tiers' lossless defaults. A daemon's tiers are its own
            (``kvstore serve --disk-codec``).
        wire_codec: the daemon client's wire codec (``kvstore.daemon.wire_codec``): chunks of
            namespaces whose ``lossy_codec`` names it travel to and from the daemon encoded
            (HTTP only); ``""`` (default): raw, bit-exact.

    Raises:
        ValueError: at construction, a ``remote_url`` that does not parse (the message never
            holds the password).
    """

    cpu_bytes: int | str | None = None
    disk_path: str | None = None
    disk_bytes: int | str | None = None
    url: str | None = None
    auth_token: str | None = None
    timeout_s: float = 0.5
    breaker: BreakerTimes | None = None
    name: str = "default"
    remote_url: str | None = None
    remote_key_prefix: str = "kvstore"
    remote_ttl_s: float = 0.0
    remote_timeout_s: float = 0.25
    remote_password: str | None = field(default=None, repr=False)
    lossy_codec: str = ""
    wire_codec: str = ""

    def __post_init__(self) -> None:
        if not self.remote_url:
            object.__setattr__(self, "remote_url", None)
            return
        from kvstore.tiers.redis_url import parse_redis_url
        ep = parse_redis_url(self.remote_url, env={})
        if ep.password:  # out of repr (a spec is logged) and of the registry's key
            if self.remote_password is None:
                object.__setattr__(self, "remote_password", ep.password)
            object.__setattr__(self, "remote_url", ep.without_password())

    def check(self) -> None:
        """Raises:
            ValueError: no store given, ``disk_bytes`` without ``disk_path``, a bad URL, a
                ``remote_url`` with a daemon but no in-process tiers."""
        if self.disk_bytes and not self.disk_path:
            raise ValueError("disk_bytes needs disk_path")
        if not (self.local or self.url):
            raise ValueError("no store: give cpu_bytes, disk_path or url")
        if self.url:
            http_url(self.url)
        if self.remote_url and self.url and not (self.cpu_bytes or self.disk_path):
            raise ValueError("remote_url is a tier of the in-process store and url names only "
                             "a daemon: give the daemon the remote tier (kvstore serve "
                             "--remote-url) instead, or add in-process tiers (cpu_bytes)")

    @property
    def local(self) -> bool:
        """Whether the spec names in-process tiers (a remote tier alone brings a CPU tier;
        with a daemon it is refused by ``check``)."""
        return bool(self.cpu_bytes) or bool(self.disk_path) or (
            bool(self.remote_url) and not self.url)

    def store_config(self):
        """The ``kvstore.config.StoreConfig`` of the in-process store.

        Raises:
            ValueError: as ``StoreConfig`` (a bad size, remote TTL or timeout).
        """
        from kvstore.config import StoreConfig
        cpu = self.cpu_bytes or 0
        if not cpu and not self.disk_path and self.remote_url:
            cpu = DEFAULT_CPU_BYTES
        remote = {}
        if self.remote_url:
            remote = dict(remote_url=self.remote_url, remote_key_prefix=self.remote_key_prefix,
                          remote_ttl_s=self.remote_ttl_s, remote_timeout_s=self.remote_timeout_s,
                          remote_password=self.remote_password)
        if self.lossy_codec and self.remote_url:
            remote["remote_codec"] = self.lossy_codec
        codec = {"disk_codec": self.lossy_codec} if self.lossy_codec and self.disk_path else {}
        return StoreConfig(cpu_bytes=cpu,
                           disk_bytes=(self.disk_bytes or DEFAULT_DISK_BYTES)
                           if self.disk_path else 0,
                           disk_path=self.disk_path, **codec, **remote)


@dataclass(frozen=True)
class OpenedStore:
    """An opened store and what the daemon said about its token.

    Attributes:
        store: the store (``ChunkStore``, the daemon client or its breaker, ``LayeredStore``).
        tenant_salt: the daemon tenant's salt every namespace must carry; None without a
            daemon, an auth token, or for an unbound (admin) token.
        remote: whether ``store`` is the bare daemon client (its calls take ``timeout_s=``).
        role: the daemon token's role (``"admin"``, ``"tenant"``, ``"reader"``: read-only)
            as ``GET /v1/whoami`` said; None without a daemon or when it could not be asked.
    """

    store: KVStoreBase
    tenant_salt: str | None = None
    remote: bool = False
    role: str | None = None


def open_store(spec: StoreSpec) -> OpenedStore:
    """Open the store ``spec`` describes (see module docstring); the caller closes it. On an
    error nothing stays open.

    Raises:
        ValueError: as ``StoreSpec.check``; a bad size; a remote tier that cannot start
            (``kvstore.tiers.redis_nodes.RemoteConfigError``: Redis unreachable, the password
            refused, not the cluster the URL names).
        OSError: a disk path that cannot be opened (a file, not writable, in use).
    """
    spec.check()
    stores: list[KVStoreBase] = []
    if spec.local:
        from kvstore.store import ChunkStore
        stores.append(ChunkStore(spec.store_config()))
    try:
        return _with_daemon(spec, stores)
    except BaseException:
        for store in stores:   # the in-process tiers opened above (a disk path's lock)
            store.close()
        raise


def _with_daemon(spec: StoreSpec, stores: list[KVStoreBase]) -> OpenedStore:
    """``stores`` (the in-process one, if any) plus the daemon ``spec.url`` names, as one
    ``OpenedStore``."""
    salt = role = who = None
    if spec.url:
        from kvstore.daemon.client import KVStoreClient
        client = KVStoreClient(http_url(spec.url), auth_token=spec.auth_token,
                               timeout_s=spec.timeout_s, wire_codec=spec.wire_codec or "raw")
        who = daemon_whoami(client, max(spec.timeout_s, WHOAMI_TIMEOUT_S),
                            token=bool(spec.auth_token)) or {}
        salt = who.get("cache_salt") if isinstance(who.get("cache_salt"), str) else None
        role = who.get("role") if isinstance(who.get("role"), str) else None
        if spec.breaker is None:
            stores.append(client)
        else:
            from kvstore.layered import CircuitBreakerStore
            b = spec.breaker
            stores.append(CircuitBreakerStore(
                client, put_timeout_s=b.put_timeout_s,
                get_timeout_s_per_chunk=b.get_timeout_s_per_chunk,
                get_timeout_s_base=b.get_timeout_s_base))
    from connectors.codec_check import warn_unused_lossy_codec
    warn_unused_lossy_codec(spec.lossy_codec, stores[0].config.tier_codecs() if spec.local
                            else None, who, spec.wire_codec, spec.url)
    if len(stores) == 1:
        return OpenedStore(stores[0], salt, remote=bool(spec.url) and spec.breaker is None,
                           role=role)
    from kvstore.layered import LayeredStore
    return OpenedStore(LayeredStore(stores[0], stores[1], remote_read_only=role == "reader"),
                       salt, role=role)


def engine_saves(opened: OpenedStore, quiet: bool = False) -> bool:
    """Whether an engine saves into ``opened``: False for a daemon token with the read-only
    role (``reader``) when the daemon is the only store (the engine loads from it and saves
    nothing: each put would be refused 403; one INFO line says so unless ``quiet``); True
    otherwise, in front of in-process tiers too (their ``LayeredStore`` keeps saves local and
    sends the daemon nothing; it logged so when it opened)."""
    from kvstore.layered import LayeredStore
    if opened.role != "reader" or isinstance(opened.store, LayeredStore):
        return True
    if not quiet:
        log.info("kvstore daemon %s: this token is read-only (role reader): the engine loads "
                 "from it and saves nothing", getattr(opened.store, "url", None))
    return False


def daemon_tenant_salt(client: Any, timeout_s: float, token: bool = True) -> str | None:
    """The salt the daemon binds ``client``'s token to (``GET /v1/whoami``, asked once at
    start, also without a token: it checks the daemon answers and accepts this engine), or
    None for an unbound (admin) token or none. A daemon that cannot be asked (down, an old
    version, a missing or wrong token) also gives None, with one WARNING that says why and
    what follows: the connector then names unsalted namespaces, which a tenant token is
    refused (403), so it recomputes; it never reads another tenant's chunks.
    """
    salt = (daemon_whoami(client, timeout_s, token) or {}).get("cache_salt")
    return salt if isinstance(salt, str) else None


def daemon_whoami(client: Any, timeout_s: float, token: bool = True) -> dict | None:
    """The daemon's ``GET /v1/whoami`` answer for ``client``'s token (``{"tenant", "role",
    "cache_salt"}``), or None, with one WARNING, when it cannot be asked (as
    ``daemon_tenant_salt``)."""
    from kvstore.daemon.client import RemoteError, StoreUnavailable
    from kvstore.errors import NotADaemon
    try:
        who = client.whoami(timeout_s=timeout_s)
    except StoreUnavailable as e:
        log.warning("kvstore daemon %s is not answering (%s): requests recompute until it "
                    "does%s", client.url, e,
                    "; this token's tenant salt is then unknown until the engine restarts"
                    if token else "")
        return None
    except NotADaemon as e:
        log.warning("%s: requests recompute (check --kvstore-url)", e)
        return None
    except RemoteError as e:
        if e.status in (401, 403):
            log.warning("kvstore daemon %s refuses this engine (%s: %s): every request "
                        "recomputes; give the daemon's token (--kvstore-auth-token, "
                        "$KVSTORE_AUTH_TOKEN, vLLM's auth_token)", client.url, e.status,
                        "wrong token" if token else "no token given")
        else:
            log.warning("kvstore daemon %s: cannot learn this token's tenant salt (%s); its "
                        "requests may be refused until the engine restarts", client.url, e)
        return None
    except ValueError as e:
        log.warning("kvstore daemon %s: cannot learn this token's tenant salt (%s); its "
                    "requests may be refused until the engine restarts", client.url, e)
        return None
    return who if isinstance(who, dict) else None


class StoreRegistry:
    """Opened stores shared by the connector objects of one process, refcounted: the first
    ``acquire`` of a spec opens it, later ones share it, the release of the last handle
    closes it. Each ``acquire`` returns its own handle (an ``OpenedStore`` of the shared
    store), and ``release`` takes that handle, so a holder that releases twice cannot close
    the store under another holder. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[StoreSpec, tuple[OpenedStore, list[OpenedStore]]] = {}

    def acquire(self, spec: StoreSpec) -> OpenedStore:
        """A handle on the store of ``spec``, opened on first use; give it back with
        ``release``.

        Raises:
            ValueError: as ``open_store``.
        """
        with self._lock:
            if spec not in self._open:
                self._open[spec] = (open_store(spec), [])
            opened, holders = self._open[spec]
            handle = dataclasses.replace(opened)   # this acquire's own handle, same store
            holders.append(handle)
            return handle

    def release(self, handle: OpenedStore) -> None:
        """Give back one ``acquire``'s handle; the last one closes the store. A handle given
        back already (or not from this registry) is ignored: it holds nothing."""
        with self._lock:
            for spec, (opened, holders) in self._open.items():
                if any(h is handle for h in holders):
                    holders[:] = [h for h in holders if h is not handle]
                    break
            else:
                return
            if holders:
                return
            del self._open[spec]
        opened.store.close()

    def refs(self, spec: StoreSpec) -> int:
        """Handles held on ``spec``'s store (0 = not open)."""
        with self._lock:
            return len(self._open[spec][1]) if spec in self._open else 0
