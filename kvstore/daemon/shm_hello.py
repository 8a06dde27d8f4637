"""The first request of a same-host connection (``kvstore.daemon.shm_session``): ``hello``
checks the protocol version and the token, reads back the client's ``vm_probe``
(``kvstore.daemon.shm_vm``) and answers with the arena's descriptor
(``kvstore.daemon.shm_protocol``)."""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING, Any

from kvstore.daemon import shm_protocol as S
from kvstore.daemon import shm_vm
from kvstore.daemon.protocol import ProtocolError
from kvstore.daemon.tenants import OPEN, Tenant

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.daemon.shm_session import Connection

log = logging.getLogger("kvstore.daemon.shm_server")


async def hello(c: "Connection") -> bool:
    """Read and answer ``c``'s ``hello`` (within the request timeout); False when the
    connection must close (answered with the reason)."""
    try:
        async with asyncio.timeout(c.state.limits.request_timeout_s):
            frame = await c.read_frame()
    except (ProtocolError, TimeoutError) as e:
        await c.reply(S.error_reply(400, f"expected hello: {e}"))
        return False
    if frame is None:
        return False
    h, n = frame
    if h.get("op") != "hello" or n:
        await c.reply(S.error_reply(400, "the first request must be hello"))
        return False
    version = h.get("version")
    if type(version) is not int or version not in S.SHM_VERSIONS:
        await c.reply(S.error_reply(400, f"unsupported shm protocol version {version!r}; "
                                         f"supported: {', '.join(map(str, S.SHM_VERSIONS))}"))
        return False
    tenant = authenticate(c, h.get("token"))
    if tenant is None:
        await c.reply(S.error_reply(401, "missing or wrong token"))
        return False
    c.tenant, c.version, srv = tenant, version, c.server
    vm = {}
    if version >= 3:
        c.peer = readable_peer(c.sock, h.get("vm_probe"))
        vm = {"vm_read": c.peer is not None}
    await c.reply({"ok": True, "version": version, "instance": c.state.instance,
                   "arena_bytes": srv.arena_bytes, "page_bytes": srv.page_bytes,
                   "tenant": {"name": tenant.name, "role": tenant.role, "salt": tenant.salt},
                   "max_body_bytes": c.state.limits.max_body_bytes,
                   "max_batch_keys": c.state.limits.max_batch_keys,
                   **c.state.codec_fields(), **vm}, fds=[srv.arena_fd] if srv.arena_bytes else [])
    return True


def authenticate(c: "Connection", token: Any) -> Tenant | None:
    """The tenant of ``hello``'s ``token`` (``OPEN`` without a tenants table), or None:
    refused."""
    if c.state.tenants is None:
        return OPEN
    if not isinstance(token, str) or token != token.strip():  # (the header form strips)
        return None
    return c.state.tenants.authenticate("Bearer " + token)


def readable_peer(sock: socket.socket, probe: Any) -> "shm_vm.PeerMemory | None":
    """The connection's peer when hello's ``vm_probe`` reads back as given (puts may then
    be read from the client's memory), else None."""
    if probe is None or not shm_vm.available():
        return None
    try:
        peer = shm_vm.PeerMemory.of_socket(sock)
    except OSError:
        return None
    if peer.probe(probe):
        return peer
    log.debug("vm_probe of pid %d did not read back: puts go through staging", peer.pid)
    peer.close()
    return None


__all__ = ["hello", "authenticate", "readable_peer"]
