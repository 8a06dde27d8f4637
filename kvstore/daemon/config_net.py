"""Network defaults of ``kvstore serve``'s configuration (``kvstore.daemon.config``): the
connection cap derived from the file-descriptor limit, and what counts as a loopback bind."""
from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = ("localhost",)


def default_max_connections(nofile: int | None = None) -> int:
    """The connection cap that leaves room below the file-descriptor limit: ``nofile`` (default:
    this process's soft ``RLIMIT_NOFILE``; unlimited counts as 65,536) minus
    ``max(64, nofile // 8)`` descriptors kept for the store (disk tier, logs, pipes) minus 64
    for sockets accepted but not yet counted (``kvstore.daemon.conns.ACCEPT_BATCH``), and at
    least 1. E.g. 256 -> 128, 1,024 -> 832, 65,536 -> 57,280."""
    import resource
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if nofile == resource.RLIM_INFINITY or nofile <= 0:
        nofile = 65536
    return max(1, nofile - max(64, nofile // 8) - 64)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (``127.0.0.0/8``, ``::1``)."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
