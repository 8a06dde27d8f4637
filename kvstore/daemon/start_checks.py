"""Warnings a daemon prints at start about its configuration (``kvstore serve``): settings that
parse and are allowed, yet will not work as the user likely means (a tier too small for any real
model's chunk, a disk tier larger than its filesystem's free space, a setting that has no effect
with the others)."""
from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

from kvstore.units import format_size

if TYPE_CHECKING:
    from kvstore.daemon.config import ServeConfig

#: Bytes of one 256-token fp16 chunk of SmolLM2-135M (30 layers x 2 x 256 x 3 x 64 x 2), the
#: smallest real model the project ships: a tier below it holds no default-size (256-token)
#: chunk of any real model.
SMALLEST_REAL_CHUNK_BYTES = 30 * 2 * 256 * 3 * 64 * 2


def tier_warnings(cfg: ServeConfig) -> list[str]:
    """What a daemon started with ``cfg`` should warn about at start (one line each): a tier
    smaller than ``SMALLEST_REAL_CHUNK_BYTES`` (every namespace whose chunk does not fit each
    tier is refused with 400 at first use), and a disk tier larger than the free space of its
    filesystem (lmdb's map is sparse, so it starts; the disk tier lowers its capacity to what
    the filesystem can hold, ``kvstore.tiers.disk_writer``)."""
    out = []
    for tier in ("gpu", "cpu", "disk"):
        n = getattr(cfg, f"{tier}_bytes")
        if 0 < n < SMALLEST_REAL_CHUNK_BYTES:
            out.append(f"the {tier} tier ({format_size(n)}, --{tier}-bytes) is smaller than one "
                       f"256-token fp16 chunk of SmolLM2-135M "
                       f"({format_size(SMALLEST_REAL_CHUNK_BYTES)}): a namespace whose chunk does "
                       f"not fit every tier is refused (400) when first used")
    if cfg.disk_path is not None and cfg.disk_bytes > 0:
        probe = cfg.disk_path
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe.rstrip("/"))
        try:
            free = shutil.disk_usage(probe or ".").free
        except OSError:
            free = None
        if free is not None and cfg.disk_bytes > free:
            out.append(f"the disk tier ({format_size(cfg.disk_bytes)}, --disk-bytes) is larger "
                       f"than the {format_size(free)} free at {cfg.disk_path!r}: the tier's "
                       f"capacity is lowered to what the filesystem can hold")
    return out


def start_warnings(cfg: ServeConfig) -> list[str]:
    """Every warning of ``kvstore serve`` at start: ``tier_warnings`` then
    ``unused_setting_warnings``, one line each."""
    return tier_warnings(cfg) + unused_setting_warnings(cfg)


def unused_setting_warnings(cfg: ServeConfig) -> list[str]:
    """Settings that take no effect with the others (one line each): a disk codec without a
    disk tier, a remote codec without a remote tier, and ``--auth-token`` beside
    ``--tenants-file``, where both are accepted (the token is one more admin tenant named
    ``admin``, ``kvstore.daemon.state.tenant_table``), which a user may not expect."""
    out = []
    if cfg.disk_codec != "auto" and cfg.disk_path is None:
        out.append(f"--disk-codec {cfg.disk_codec} has no effect without a disk tier "
                   f"(--disk-path)")
    if cfg.remote_codec != "raw" and cfg.remote_url is None:
        out.append(f"--remote-codec {cfg.remote_codec} has no effect without a remote tier "
                   f"(--remote-url)")
    if cfg.auth_token and cfg.tenants_file:
        out.append("--auth-token and --tenants-file are both set: neither replaces the other; "
                   "the token is one more admin (tenant 'admin', every namespace) beside the "
                   "file's tenants")
    return out
