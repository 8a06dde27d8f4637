"""Configuration of ``kvstore serve``: command-line flags > ``KVSTORE_*`` env vars > a YAML/TOML
file > defaults.

The file holds the same field names (``cpu_bytes: 8GiB``, dashes or underscores), at top level
or under a ``serve`` table. Each environment variable is the field name upper-cased with the
``KVSTORE_`` prefix (``KVSTORE_CPU_BYTES=8GiB``); ``KVSTORE_CONFIG`` names the file.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from kvstore.daemon import config_env
from kvstore.daemon.config_env import ENV_PREFIX, OTHER_ENV, EnvValueError  # noqa: F401
from kvstore.daemon.config_net import default_max_connections, is_loopback  # noqa: F401
from kvstore.defaults import DEFAULT_DISK_BYTES
from kvstore.units import parse_size

log = logging.getLogger("kvstore.daemon.config")


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``kvstore serve`` needs. Sizes are bytes (text like ``"8GiB"`` accepted).

    Attributes:
        host, port: bind address (default loopback ``127.0.0.1:8500``; port 0 = any free port).
        cpu_bytes, gpu_bytes, disk_bytes: tier capacities (0 = tier absent; ``disk_bytes``
            unset = ``DEFAULT_DISK_BYTES`` with a ``disk_path``, else 0).
        disk_path: lmdb directory of the disk tier (with ``disk_bytes`` 0 or without a path
            but ``disk_bytes`` > 0: ``ValueError``).
        disk_shrink: when ``disk_path`` already holds more than ``disk_bytes``, evict chunks at
            start until it fits (``--disk-shrink``); default False: refuse to start, naming
            both sizes (``kvstore.config.StoreConfig.allow_disk_shrink``).
        device: device of the GPU tier (``cuda``, ``cuda:1``).
        policy: eviction policy of every tier (``lru``, ``lfu``, ``fifo``, ``s3fifo``, ``arc``).
        admission: admission filter of the tiers (``none``, ``tinylfu``; see
            ``kvstore.config.StoreConfig.admission``).
        auth_token: bearer token required by the server (an admin: see ``kvstore.daemon.tenants``).
        tenants_file: YAML/TOML/JSON file of tenants with their own tokens, roles and salts
            (``kvstore.daemon.tenants``); read at start.
        page_bytes: allocation unit of the memory tiers (bytes, a positive multiple of 64). A
            chunk takes ``ceil(chunk bytes / page_bytes)`` whole pages, so a page larger than a
            namespace's chunk wastes the rest: 4 KiB chunks in 64 KiB pages used 6% of the
            tier. Default 4 KiB (the OS page): the daemon serves namespaces of any chunk size,
            large chunks simply span many pages (pages are handed out in runs, so a 5.9 MB
            chunk costs no more than with 64 KiB pages), and a chunk wastes under 4 KiB.
        insecure: allow a non-loopback bind without a token.
        log_level: ``debug``/``info``/``warning``/``error``.
        max_body_bytes, max_batch_keys, request_timeout_s, max_lease_s: see
            ``kvstore.daemon.server.ServerLimits``.
        shutdown_timeout_s: how long SIGTERM waits for in-flight requests (seconds).
        persist_on_shutdown_s: after that drain, how long SIGTERM/SIGINT may spend writing
            the memory tiers' chunks that the disk tier lacks to it, hottest first, so a
            restart on the same ``disk_path`` keeps them (``ChunkStore.persist_memory_tiers``;
            bounded by the disk tier's free room too); 0 = none. Without a disk tier: nothing
            to do. A SIGKILL writes nothing.
        http_parser: ``python`` (default) runs aiohttp's pure-Python HTTP parser, which hands
            each received body piece through without copying it (its C parser copies every
            piece: measured +15-20% put throughput, lookups unchanged); ``c`` its C parser.
            Takes effect when ``kvstore serve`` imports aiohttp (``AIOHTTP_NO_EXTENSIONS``).
        max_inflight_bytes: budget of chunk payload bytes that requests hold at once (see
            ``kvstore.daemon.server.ServerLimits``); None = auto: a sixteenth of the memory tiers'
            capacity, at least 32 MiB; 0 = no budget. Chunks put into or sent from the CPU
            tier take none of it (direct I/O); it bounds staging: durable puts, chunks read
            from the disk tier, and puts that find the CPU tier full of pinned chunks.
        max_connections: cap on open client connections (``kvstore.daemon.conns``); at the cap
            a new connection closes the oldest idle one, or gets 503 when all are busy.
            None = auto: the soft ``RLIMIT_NOFILE`` minus ``max(64, limit // 8)`` descriptors
            kept for the store and 64 for a burst of accepts (256 -> 128, 1,024 -> 832);
            0 = no cap.
        idle_timeout_s: a connection that has not sent a complete request's headers this many
            seconds after connecting or after its last response is closed (silent or
            trickling clients; aiohttp's ``keepalive_timeout``).
        max_namespaces: namespaces whose layout the store keeps checked at once
            (``ChunkStore.register``); beyond, the least recently used is forgotten (counted
            in ``kvstore_namespace_evictions_total``; its chunks stay, a later request
            checks its layout again).
        remote_url: Redis below the local tiers, shared by every daemon pointing at it
            (``redis://[user:password@]host:port[,host:port...]``: one address = standalone or
            a cluster seed, several = cluster startup nodes; ``rediss://`` = TLS; see
            ``kvstore.tiers.remote``); None = no remote tier. A password in the URL moves to
            ``remote_password``.
        remote_key_prefix: deployment prefix of every Redis key (``<prefix>:<ns>:<hash>``).
        remote_ttl_s: seconds a value lives in Redis after its last write or read (0 = no
            expiry: Redis's ``maxmemory`` policy evicts).
        remote_timeout_s: deadline of the wait for Redis's answers in a remote lookup
            (seconds; a get adds time per GiB; decoding what came in time runs after it).
        remote_restart_check_s: seconds between checks of each Redis master's run_id (a master
            restarted empty gets the local chunks it lacks again; 0 = no check).
        remote_queue_bytes: most chunk bytes waiting to be written to Redis (beyond: dropped).
        remote_password: Redis password when the URL has none; no flag (it would show in
            ``ps``): ``$KVSTORE_REMOTE_PASSWORD`` or the config file. Never in ``repr``.
        unix_socket: path of a Unix socket for same-host clients (``unix:///PATH`` or
            ``PATH``; made absolute): they map the CPU arena read-only and read chunks from it
            (``kvstore.daemon.shm_server``); the CPU tier is then a shared arena. None = HTTP
            only.
        disk_codec, remote_codec: value codecs of the disk and remote tiers
            (``kvstore.config.StoreConfig``; lossy ``int8``/``fp8`` only for the chunks of
            namespaces whose ``lossy_codec`` names it).

    Raises:
        ValueError: a bad size (``page_bytes`` not a positive multiple of 64), port, log level
            or timeout (not a positive number of seconds), a non-loopback bind without
            ``auth_token``, ``tenants_file`` or ``insecure``, or a bad remote URL, TTL, timeout
            or queue size (messages never hold the password), a Unix socket path longer
            than 107 bytes, or no tier at all (cpu, gpu and disk bytes all 0).
    """

    host: str = "127.0.0.1"
    port: int = 8500
    cpu_bytes: int | str = "1GiB"
    gpu_bytes: int | str = 0
    disk_bytes: int | str | None = None
    disk_path: str | None = None
    disk_shrink: bool = False
    device: str = "cuda"
    policy: str = "lru"
    admission: str = "none"
    auth_token: str | None = None
    tenants_file: str | None = None
    page_bytes: int | str = "4KiB"
    insecure: bool = False
    log_level: str = "info"
    max_body_bytes: int | str = "1GiB"
    max_batch_keys: int = 1024
    request_timeout_s: float = 60.0
    max_lease_s: float = 300.0
    shutdown_timeout_s: float = 30.0
    persist_on_shutdown_s: float = 30.0
    max_connections: int | str | None = None
    idle_timeout_s: float = 30.0
    max_namespaces: int = 4096
    http_parser: str = "python"
    max_inflight_bytes: int | str | None = None
    remote_url: str | None = None
    remote_key_prefix: str = "kvstore"
    remote_ttl_s: float = 0.0
    remote_timeout_s: float = 0.25
    remote_restart_check_s: float = 10.0
    remote_queue_bytes: int | str = "256MiB"
    remote_password: str | None = field(default=None, repr=False)
    unix_socket: str | None = None
    disk_codec: str = "auto"
    remote_codec: str = "raw"

    def __post_init__(self) -> None:
        from kvstore.config import DISK_CODECS
        for name in ("disk_codec", "remote_codec"):
            if getattr(self, name) not in DISK_CODECS:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of "
                                 f"{DISK_CODECS}")
        if self.disk_path in ("", None):
            object.__setattr__(self, "disk_path", None)
        if self.disk_bytes is None:     # a disk path alone gets the default capacity
            object.__setattr__(self, "disk_bytes",
                               DEFAULT_DISK_BYTES if self.disk_path is not None else 0)
        for name in ("cpu_bytes", "gpu_bytes", "disk_bytes", "max_body_bytes", "page_bytes"):
            object.__setattr__(self, name, _size(name, getattr(self, name)))
        if self.disk_path is not None and self.disk_bytes <= 0:
            raise ValueError(f"disk_path {self.disk_path!r} with disk_bytes "
                             f"{self.disk_bytes}: give the disk tier a capacity (or leave "
                             f"disk_bytes out: {DEFAULT_DISK_BYTES})")
        if self.disk_path is None and self.disk_bytes > 0:
            raise ValueError(f"disk_bytes {self.disk_bytes} without disk_path: say where the "
                             "disk tier lives (--disk-path, $KVSTORE_DISK_PATH or 'disk_path' "
                             "in the config file)")
        if self.cpu_bytes + self.gpu_bytes + self.disk_bytes <= 0:
            raise ValueError("no tier to store chunks in: give --cpu-bytes or --gpu-bytes a size "
                             "> 0, or a disk tier with --disk-path (and --disk-bytes)")
        if self.max_inflight_bytes is None or str(self.max_inflight_bytes).lower() == "auto":
            object.__setattr__(self, "max_inflight_bytes",
                               max(32 << 20, (self.cpu_bytes + self.gpu_bytes) // 16))
        else:
            object.__setattr__(self, "max_inflight_bytes",
                               _size("max_inflight_bytes", self.max_inflight_bytes))
        for name, typ in (("port", int), ("max_batch_keys", int), ("request_timeout_s", float),
                          ("max_lease_s", float), ("shutdown_timeout_s", float),
                          ("persist_on_shutdown_s", float),
                          ("idle_timeout_s", float), ("max_namespaces", int)):
            object.__setattr__(self, name, _as(name, typ, getattr(self, name)))
        if self.max_connections is None or str(self.max_connections).lower() == "auto":
            object.__setattr__(self, "max_connections", default_max_connections())
        object.__setattr__(self, "max_connections",
                           _as("max_connections", int, self.max_connections))
        if self.max_connections < 0 or self.max_namespaces <= 0:
            raise ValueError(f"max_connections must be >= 0 (0: no cap) and max_namespaces "
                             f"> 0, got {self.max_connections} and {self.max_namespaces}")
        object.__setattr__(self, "insecure", config_env.to_bool(self.insecure))
        object.__setattr__(self, "disk_shrink", config_env.to_bool(self.disk_shrink))
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(f"unknown log level {self.log_level!r}")
        from kvstore.eviction import POLICIES
        if self.policy not in POLICIES:
            raise ValueError(f"unknown --policy {self.policy!r} (also $KVSTORE_POLICY or "
                             f"'policy' in the config file); choose one of "
                             f"{', '.join(sorted(POLICIES))}")
        from kvstore.eviction import ADMISSIONS
        if self.admission not in ADMISSIONS:
            raise ValueError(f"unknown --admission {self.admission!r} (also $KVSTORE_ADMISSION "
                             f"or 'admission' in the config file); choose one of "
                             f"{', '.join(ADMISSIONS)}")
        if self.max_batch_keys <= 0 or self.max_body_bytes <= 0:
            raise ValueError("max_batch_keys and max_body_bytes must be positive")
        for name in ("request_timeout_s", "max_lease_s", "idle_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:  # also refuses NaN
                raise ValueError(f"{name} must be a positive number of seconds, got "
                                 f"{getattr(self, name)}")
        for name in ("shutdown_timeout_s", "persist_on_shutdown_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        if self.page_bytes <= 0 or self.page_bytes % 64:
            raise ValueError(f"page_bytes must be a positive multiple of 64, got "
                             f"{self.page_bytes}")
        if self.http_parser not in ("python", "c"):
            raise ValueError(f"http_parser must be 'python' or 'c', got {self.http_parser!r}")
        self._check_remote()
        self._check_unix_socket()
        if not (self.auth_token or self.tenants_file or self.insecure
                or is_loopback(self.host)):
            raise ValueError(f"refusing to bind non-loopback address {self.host!r} without "
                             "--auth-token or --tenants-file (or --insecure to accept "
                             "unauthenticated access)")

    def _check_remote(self) -> None:
        """Normalise the remote fields (empty text = unset; a URL password moves to
        ``remote_password``) and check them, so a bad one fails before any tier is built."""
        for name in ("remote_url", "remote_password"):
            if getattr(self, name) == "":
                object.__setattr__(self, name, None)
        for name in ("remote_ttl_s", "remote_timeout_s", "remote_restart_check_s"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "remote_queue_bytes", parse_size(self.remote_queue_bytes))
        if not self.remote_ttl_s >= 0 or not 0 < self.remote_timeout_s < math.inf:
            raise ValueError(f"remote_ttl_s must be >= 0 and remote_timeout_s a positive number "
                             f"of seconds, got {self.remote_ttl_s} and {self.remote_timeout_s}")
        if self.remote_queue_bytes <= 0 or not 0 <= self.remote_restart_check_s < math.inf:
            raise ValueError(f"remote_queue_bytes must be > 0 and remote_restart_check_s >= 0, "
                             f"got {self.remote_queue_bytes} and {self.remote_restart_check_s}")
        if self.remote_url is None:
            return
        from kvstore.tiers.redis_url import parse_redis_url
        ep = parse_redis_url(self.remote_url, env={})
        if ep.password:  # keep it out of repr and of every message that shows the URL
            if self.remote_password is None:
                object.__setattr__(self, "remote_password", ep.password)
            object.__setattr__(self, "remote_url", ep.without_password())

    def _check_unix_socket(self) -> None:
        path = self.unix_socket
        if path in (None, ""):
            object.__setattr__(self, "unix_socket", None)
            return
        path = str(path)
        if path.startswith("unix://") and not path.startswith("unix:///"):
            raise ValueError(f"unix_socket {path!r}: a URL takes an absolute path, "
                             f"unix:///ABSOLUTE/PATH (a plain path may be relative)")
        path = os.path.abspath(path.removeprefix("unix://"))
        if len(os.fsencode(path)) > 107:
            raise ValueError(f"unix_socket path {path!r} is longer than 107 bytes (the limit "
                             "of a Unix socket address)")
        object.__setattr__(self, "unix_socket", path)

    def store_config_kwargs(self) -> dict:
        """Keyword arguments of ``kvstore.config.StoreConfig`` for these tiers (and the remote
        tier when ``remote_url`` is set)."""
        out = {"gpu_bytes": self.gpu_bytes, "cpu_bytes": self.cpu_bytes,
               "disk_bytes": self.disk_bytes, "disk_path": self.disk_path,
               "allow_disk_shrink": self.disk_shrink,
               "page_bytes": self.page_bytes,
               "device": self.device if self.gpu_bytes else "cpu",
               "gpu_policy": self.policy, "cpu_policy": self.policy,
               "disk_policy": self.policy, "admission": self.admission,
               "max_namespaces": self.max_namespaces,
               "disk_codec": self.disk_codec if self.disk_path is not None else "auto",
               "cpu_shared": self.unix_socket is not None and self.cpu_bytes > 0}
        if self.remote_url is not None:
            out.update(remote_url=self.remote_url, remote_key_prefix=self.remote_key_prefix,
                       remote_ttl_s=self.remote_ttl_s, remote_timeout_s=self.remote_timeout_s,
                       remote_restart_check_s=self.remote_restart_check_s,
                       remote_queue_bytes=self.remote_queue_bytes,
                       remote_codec=self.remote_codec, remote_password=self.remote_password)
        return out


FIELDS = tuple(f.name for f in fields(ServeConfig))


def _size(name: str, value: Any) -> int:
    """``parse_size(value)``, or ``ValueError`` naming the setting (``cpu_bytes: not a byte
    size: 'lots' ...``)."""
    try:
        return parse_size(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _as(name: str, typ: type, value: Any) -> Any:
    """``typ(value)``, or ``ValueError`` naming the setting (``port 'abc' is not an int``)."""
    if isinstance(value, bool) or (typ is int and isinstance(value, float)):
        raise ValueError(f"{name} {value!r} is not an {typ.__name__}")
    try:
        return typ(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} {value!r} is not "
                         f"{'an int' if typ is int else 'a number'}") from None


def load_file(path: str | os.PathLike) -> dict:
    """Fields from a YAML (``.yaml``/``.yml``) or TOML (``.toml``) file.

    Raises:
        ValueError: unreadable/malformed file, or unknown field names.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read config file {p}: {e}") from None
    if p.suffix == ".toml":
        import tomllib
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"malformed TOML in {p}: {e}") from None
    else:
        import yaml
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"malformed YAML in {p}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p} must hold a mapping of settings")
    if isinstance(data.get("serve"), dict):
        data = data["serve"]
    return _known(data, str(p))


def _known(data: Mapping[str, Any], where: str) -> dict:
    out = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(out) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown settings {unknown} in {where}; known: {list(FIELDS)}")
    return out


def from_env(env: Mapping[str, str]) -> dict:
    """Fields set by ``KVSTORE_<FIELD>`` variables (``KVSTORE_CONFIG`` excluded), parsed to
    their types (``kvstore.daemon.config_env.from_env``).

    Raises:
        EnvValueError: a value that cannot be parsed, naming the variable and the value.
    """
    return config_env.from_env(env, FIELDS)


def unknown_env(env: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``(name, closest setting variable or None)`` of each ``KVSTORE_*`` variable in ``env``
    that names no setting, in name order (``kvstore.daemon.config_env.unknown_env``)."""
    return config_env.unknown_env(env, FIELDS)


def resolve(flags: Mapping[str, Any], env: Mapping[str, str] | None = None,
            config_file: str | None = None) -> ServeConfig:
    """Merge the layers: ``flags`` (None values = not given) > env > file > defaults.

    The file is ``config_file`` or else ``$KVSTORE_CONFIG``. A ``KVSTORE_*`` variable that
    names no setting is logged (WARNING) and ignored.

    Raises:
        EnvValueError: a ``KVSTORE_*`` value that cannot be parsed (named with its value).
        ValueError: a bad setting from any layer (see ``ServeConfig``), a bad file, or
            remote-tier settings while no layer gives ``remote_url`` (named as given).
    """
    env = os.environ if env is None else env
    for name, close in unknown_env(env):
        log.warning("%s is not a kvstore serve setting: ignored%s", name,
                    f" (did you mean {close}?)" if close else "")
    path = config_file or env.get(ENV_PREFIX + "CONFIG")
    file = load_file(path) if path else {}
    given = {k: v for k, v in _known(flags, "flags").items() if v is not None}
    envs = from_env(env)
    merged: dict[str, Any] = {**file, **envs, **given}
    orphans, password = config_env.remote_without_url(file, envs, given)
    if orphans:
        raise ValueError(f"remote-tier settings without a remote URL (--remote-url, "
                         f"KVSTORE_REMOTE_URL or remote_url): {', '.join(orphans)}")
    if password:
        log.warning("remote password (KVSTORE_REMOTE_PASSWORD or remote_password) set but "
                    "no remote URL: ignored, no remote tier")
    return ServeConfig(**merged)
