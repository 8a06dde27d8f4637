"""Store configuration: a frozen, validated dataclass.

Byte capacities accept ints or size text (``"8GiB"``, see ``kvstore.units``). A tier with
capacity 0 is absent. Tier order is fixed: GPU -> CPU -> DISK (fastest first).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields

from kvstore.eviction import ADMISSIONS, POLICIES
from kvstore.kv_codec import LOSSY_CODECS
from kvstore.layout import KVLayout
from kvstore.units import format_size, parse_size

log = logging.getLogger("kvstore.config")

TIER_NAMES = ("gpu", "cpu", "disk")
#: Value codecs of the disk and remote tiers: lossless, then the lossy ones
#: (``kvstore.kv_codec``), used only for chunks of namespaces that accept them.
DISK_CODECS = ("auto", "raw", "lz4", "shuffle-lz4") + LOSSY_CODECS


@dataclass(frozen=True)
class StoreConfig:
    """Capacities and policies of a ``ChunkStore``.

    Attributes:
        gpu_bytes: GPU-tier pool bytes (0 = no GPU tier). Preallocated on ``device``.
        cpu_bytes: CPU-tier arena bytes (0 = no CPU tier). Preallocated (pinned under CUDA).
        cpu_shared: put the CPU arena in a sealed anonymous memory file that same-host clients
            can map read-only (``kvstore.tiers.cpu``; the daemon's ``--unix-socket`` path);
            needs a CPU tier.
        disk_bytes: disk-tier bytes of stored values (0 = no disk tier); needs ``disk_path``.
        disk_path: lmdb directory (created if missing).
        allow_disk_shrink: when ``disk_path`` already holds more than ``disk_bytes`` (a
            restart with a smaller capacity), evict chunks by policy at open until it fits;
            default False: the store refuses to open (``DiskShrinkRefused``, a ``ValueError``
            naming both sizes), so a mistyped capacity does not wipe the cache.
        device: device of the GPU tier (``"cuda"``, ``"cuda:1"``; ``"cpu"`` runs the GPU tier's
            code on the CPU, as on a CPU-only machine).
        return_device: device of the tensors ``get_chunks`` returns.
        gpu_policy, cpu_policy, disk_policy: eviction policy names (``lru``, ``lfu``, ``fifo``,
            ``s3fifo``, ``arc``).
        admission: admission filter of the store's tiers (``kvstore.eviction.admission``):
            ``none`` (default: a chunk that fits by evicting goes in) or ``tinylfu`` (a chunk
            enters a full tier, by a put, a promotion or a spill, only if it was requested
            more often lately than the victim it would evict; one frequency sketch for the
            whole store, fed by every chunk read and put).
        promote_on_hit: copy a chunk read from a lower tier into the top tier.
        page_bytes: allocation unit of the GPU and CPU pools; a chunk takes
            ``ceil(chunk_bytes / page_bytes)`` pages, so chunks of any size share one arena
            and each wastes less than one page. Default 4 KiB (the OS page): a chunk of 4 KiB
            or more uses at least half its pages' bytes, a multiple of 4 KiB (every layout of
            a real model) all of them; large chunks span many pages at no extra cost (the
            allocator hands out runs, ``kvstore.tiers.memory``). 64 KiB pages left 4 KiB
            chunks using 6% of a tier.
        disk_codec: ``auto`` (byte-shuffle + lz4, raw when that saves < 10%), ``raw``, ``lz4``,
            ``shuffle-lz4``; or lossy ``kivi`` / ``int8`` / ``fp8`` (``kvstore.kv_codec``): used for the
            chunks of namespaces whose ``lossy_codec`` names it, every other chunk is written
            with ``auto``. Without a disk tier a setting other than ``auto`` does nothing: one
            WARNING says so (as ``kvstore serve --disk-codec`` without ``--disk-path``).
        max_namespaces: namespaces whose layout check the store remembers
            (``ChunkStore.register``); the least recently used beyond are forgotten and counted
            (``namespace_evictions``). A forgotten namespace loses nothing: its chunks stay and
            its next call checks its layout again (a few microseconds).
        remote_url: Redis below the local tiers, shared by every store pointing at it
            (``redis://[user:password@]host:port[,host:port...]``: one address = standalone
            or a cluster seed, several = cluster startup nodes; ``rediss://`` = TLS); None = no
            remote tier. See ``kvstore.tiers.remote``. A password in the URL moves to
            ``remote_password`` (never shown by ``repr`` or ``to_dict``).
        remote_key_prefix: deployment prefix of every Redis key.
        remote_ttl_s: seconds a value lives after its last write or read (0 = no expiry).
        remote_timeout_s: deadline of a remote lookup or get (seconds).
        remote_queue_bytes: most bytes waiting to be written to Redis (beyond: dropped).
        remote_codec: value codec in Redis (``raw``, ``auto``, ``lz4``, ``shuffle-lz4``; or
            lossy ``kivi`` / ``int8`` / ``fp8``, as ``disk_codec``, other chunks written ``raw``).
            A setting other than ``raw`` needs ``remote_url`` (refused without one, as
            ``kvstore serve`` refuses remote-tier settings without a remote URL).
        remote_password: Redis password when the URL has none (else
            ``$KVSTORE_REMOTE_PASSWORD``).
        remote_breaker_failures: consecutive failures of a Redis node that open its circuit
            breaker (its keys then miss at once).
        remote_breaker_reset_s: seconds a node's breaker stays open before one trial call.
        remote_restart_check_s: seconds between two checks of each Redis master's ``run_id``;
            a node found restarted gets the local chunks it lacks written again
            (``kvstore.republish``); 0 = no check.
        persist_on_close_s: seconds ``close`` may spend writing the memory tiers' chunks
            that the disk tier lacks to it, hottest first (``kvstore.close_persist``), so
            they survive a restart; 0 (default) = none. Needs a disk tier to do anything.

    Raises:
        ValueError: negative or unparsable sizes, no tier at all, a disk tier without a path,
            an unknown policy, admission filter or codec, a non-bool ``allow_disk_shrink``,
            ``cpu_shared`` without a CPU tier, a ``remote_codec`` other than ``raw`` without
            ``remote_url``, a page size that is not a positive multiple of
            64, a memory tier smaller than one page, a non-positive ``max_namespaces``, or a
            negative ``persist_on_close_s``.
    """

    gpu_bytes: int | str = 0
    cpu_bytes: int | str = "1GiB"
    cpu_shared: bool = False
    disk_bytes: int | str = 0
    disk_path: str | None = None
    allow_disk_shrink: bool = False
    device: str = "cpu"
    return_device: str = "cpu"
    gpu_policy: str = "lru"
    cpu_policy: str = "lru"
    disk_policy: str = "lru"
    admission: str = "none"
    promote_on_hit: bool = True
    page_bytes: int | str = "4KiB"
    disk_codec: str = "auto"
    max_namespaces: int = 4096
    remote_url: str | None = None
    remote_key_prefix: str = "kvstore"
    remote_ttl_s: float = 0.0
    remote_timeout_s: float = 0.25
    remote_queue_bytes: int | str = "256MiB"
    remote_codec: str = "raw"
    remote_password: str | None = field(default=None, repr=False)
    remote_breaker_failures: int = 3
    remote_breaker_reset_s: float = 5.0
    remote_restart_check_s: float = 10.0
    persist_on_close_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("gpu_bytes", "cpu_bytes", "disk_bytes", "page_bytes", "remote_queue_bytes"):
            object.__setattr__(self, name, parse_size(getattr(self, name)))
        if not (self.gpu_bytes or self.cpu_bytes or self.disk_bytes):
            raise ValueError("StoreConfig needs at least one tier with capacity > 0")
        if self.cpu_shared is not False and (self.cpu_shared is not True or not self.cpu_bytes):
            raise ValueError(f"cpu_shared must be a bool and needs cpu_bytes > 0, got "
                             f"{self.cpu_shared!r} with cpu_bytes={self.cpu_bytes}")
        if self.disk_bytes and not self.disk_path:
            raise ValueError("disk_bytes > 0 needs disk_path")
        if self.disk_path is not None:
            object.__setattr__(self, "disk_path", os.fspath(self.disk_path))
        if not isinstance(self.allow_disk_shrink, bool):
            raise ValueError(f"allow_disk_shrink must be a bool, got {self.allow_disk_shrink!r}")
        for tier in TIER_NAMES:
            policy = getattr(self, f"{tier}_policy")
            if policy not in POLICIES:
                raise ValueError(f"unknown {tier}_policy {policy!r}; choose one of {sorted(POLICIES)}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"unknown admission {self.admission!r}; choose one of {list(ADMISSIONS)}")
        if self.disk_codec not in DISK_CODECS:
            raise ValueError(f"unknown disk_codec {self.disk_codec!r}; choose one of {DISK_CODECS}")
        if self.disk_codec != "auto" and not self.disk_bytes:
            log.warning("disk_codec %s has no effect without a disk tier (disk_bytes and "
                        "disk_path)", self.disk_codec)
        if self.page_bytes <= 0 or self.page_bytes % 64:
            raise ValueError(f"page_bytes must be a positive multiple of 64, got {self.page_bytes}")
        if type(self.max_namespaces) is not int or self.max_namespaces <= 0:
            raise ValueError(f"max_namespaces must be a positive int, got {self.max_namespaces!r}")
        if isinstance(self.persist_on_close_s, bool) \
                or not 0 <= float(self.persist_on_close_s) < float("inf"):
            raise ValueError(f"persist_on_close_s must be a number of seconds >= 0, got "
                             f"{self.persist_on_close_s!r}")
        self._check_remote()
        for tier in ("gpu", "cpu"):
            cap = getattr(self, f"{tier}_bytes")
            if 0 < cap < self.page_bytes:
                raise ValueError(f"{tier}_bytes={cap} is smaller than one page ({self.page_bytes} bytes)")

    def _check_remote(self) -> None:
        if self.remote_url is None:
            if self.remote_codec != "raw":
                raise ValueError(f"remote-tier settings without a remote URL (remote_url): "
                                 f"remote_codec={self.remote_codec!r}")
            return
        from kvstore.tiers.redis_url import parse_redis_url
        ep = parse_redis_url(self.remote_url, env={})
        if ep.password:  # keep it out of repr/to_dict
            if self.remote_password is None:
                object.__setattr__(self, "remote_password", ep.password)
            object.__setattr__(self, "remote_url", ep.without_password())
        for name in ("remote_ttl_s", "remote_timeout_s"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if not 0 <= self.remote_ttl_s < float("inf") or not 0 < self.remote_timeout_s < float("inf"):
            raise ValueError(f"remote_ttl_s must be >= 0 (finite) and remote_timeout_s > 0 "
                             f"(finite), got {self.remote_ttl_s} and {self.remote_timeout_s}")
        from kvstore.tiers.remote_values import check_key_prefix
        check_key_prefix(self.remote_key_prefix, "remote_key_prefix")
        if type(self.remote_breaker_failures) is not int or self.remote_breaker_failures < 1 \
                or not 0 < float(self.remote_breaker_reset_s) < float("inf"):
            raise ValueError(f"remote_breaker_failures must be an int >= 1 and "
                             f"remote_breaker_reset_s > 0, got {self.remote_breaker_failures!r} "
                             f"and {self.remote_breaker_reset_s!r}")
        if not 0 <= float(self.remote_restart_check_s) < float("inf"):
            raise ValueError(f"remote_restart_check_s must be >= 0 (0: off), got "
                             f"{self.remote_restart_check_s!r}")
        if self.remote_queue_bytes <= 0:
            raise ValueError(f"remote_queue_bytes must be > 0, got {self.remote_queue_bytes}")
        if self.remote_codec not in DISK_CODECS:
            raise ValueError(f"unknown remote_codec {self.remote_codec!r}; choose one of {DISK_CODECS}")

    def tier_codecs(self) -> dict[str, str]:
        """The value codec of each present lower tier: ``{"disk": disk_codec}`` with a disk
        tier, ``{"remote": remote_codec}`` with a remote tier (``{}``: neither; the memory
        tiers always hold exact bytes). A lossy codec applies only to the chunks of
        namespaces whose ``lossy_codec`` names it."""
        out = {}
        if self.disk_bytes:
            out["disk"] = self.disk_codec
        if self.remote_url is not None:
            out["remote"] = self.remote_codec
        return out

    @property
    def tiers(self) -> tuple[str, ...]:
        """Names of the present tiers, fastest first."""
        return tuple(t for t in TIER_NAMES if getattr(self, f"{t}_bytes") > 0)

    def tier_bytes(self, tier: str) -> int:
        return getattr(self, f"{tier}_bytes")

    def footprint(self, tier: str, chunk_bytes: int) -> int:
        """Bytes a chunk of ``chunk_bytes`` takes in ``tier`` (memory tiers round up to pages)."""
        if tier == "disk":
            return chunk_bytes
        return -(-chunk_bytes // self.page_bytes) * self.page_bytes

    def check_layout(self, layout: KVLayout) -> None:
        """Check that every present tier holds at least one chunk of ``layout``.

        Raises:
            ValueError: a tier capacity smaller than one chunk, naming both sizes.
        """
        for tier in self.tiers:
            cap = self.tier_bytes(tier)
            if tier != "disk":
                cap = cap // self.page_bytes * self.page_bytes
            need = self.footprint(tier, layout.chunk_bytes)
            if cap < need:
                raise ValueError(f"{tier} tier capacity {cap} bytes ({format_size(cap)}) is smaller "
                                 f"than one chunk ({need} bytes, {format_size(need)}) of layout "
                                 f"{layout.to_dict()}")

    def to_dict(self) -> dict:
        """Every field (``remote_password`` as ``"***"`` when set)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["remote_password"]:
            out["remote_password"] = "***"
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "StoreConfig":
        """Build from a dict (e.g. parsed YAML).

        Raises:
            ValueError: an unknown field, or any validation error above.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown StoreConfig fields {unknown}; known: {sorted(known)}")
        return cls(**d)
