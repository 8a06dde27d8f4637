"""The get exchanges of the same-host client (``kvstore.daemon.shm_client``): ``copy_on``
(``get_chunks``: each chunk copied out of the arena, then the pins released at once) and
``borrow_on`` (``get_borrowed``).

A borrowed get hands out the chunks of one get as read-only views of the daemon's arena, held
by the daemon's reader pins until the caller releases them, so that a connector scatters
straight out of the arena (one copy in all, as from an in-process ``ChunkStore.borrow_chunks``)
instead of copying each chunk into a tensor first.

The pins belong to the get's connection (``kvstore.daemon.shm_protocol``): the borrow keeps
that connection out of the client's pool until ``release`` sends ``release`` on it and hands it
back. A connection that fails is closed instead, and a client that dies closes every one; the
daemon drops a closed connection's pins either way, so a borrow is never leaked in the daemon.
A pinned chunk's pages are not reused while borrowed, even when the chunk is removed or
evicted meanwhile: the views read the chunk's bytes until ``release``.

``CopiedBorrow`` gives the same surface over chunks already copied out (the HTTP path).
"""
from __future__ import annotations

import json
import threading
from typing import Any, Callable, Sequence

import torch

from kvstore.daemon import protocol as P
from kvstore.keys import ChunkKey, Namespace


class CopiedBorrow:
    """A borrow's surface over chunks the caller owns already (``get_chunks``' tensors):
    nothing to release.

    Attributes:
        keys: the requested keys.
        parts: per key, ``[chunk bytes as a 1-D uint8 tensor]``, or None when absent.
        lower: always empty (every chunk was read).
    """

    def __init__(self, keys: Sequence[ChunkKey], kvs: Sequence[torch.Tensor | None]):
        self.keys = list(keys)
        self.parts: list[list[torch.Tensor] | None] = [
            None if kv is None else [kv.reshape(-1).view(torch.uint8)] for kv in kvs]
        self.lower: list[int] = []
        self.released = False

    def read_lower(self) -> None:
        """Nothing to read (``lower`` is empty)."""

    def release(self) -> None:
        """Drop the views (idempotent)."""
        self.released = True
        self.parts = [None] * len(self.keys)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ArenaBorrow(CopiedBorrow):
    """The chunks of one get as views of the daemon's read-only arena, reader-pinned in the
    daemon until ``release`` (contract in the module docstring; the reader's side of
    ``kvstore.direct.BorrowedChunks``).

    Attributes:
        keys: the requested keys.
        parts: per key, the chunk's bytes in order as 1-D ``torch.uint8`` tensors: views of
            the arena (one per contiguous run) for a chunk in the daemon's CPU tier, one new
            tensor for a chunk its lower tiers sent inline, or None when absent. Read-only:
            writing into an arena view faults. Valid until ``release``.
        lower: always empty (the daemon's lower tiers are read in the get itself).
    """

    def __init__(self, keys: Sequence[ChunkKey], parts: list, conn, borrow: Any,
                 give: Callable[[Any], None]):
        self.keys, self.parts, self.lower = list(keys), parts, []
        self.released = False
        self._conn, self._borrow, self._give = conn, borrow, give
        self._lock = threading.Lock()

    def release(self) -> None:
        """Drop the views and the daemon's pins (``release`` on the get's connection, which
        then goes back to the client's pool and sends it ahead of its next request, or within
        ``kvstore.daemon.shm_release.RELEASE_DELAY_S``; a connection that fails to send it is
        closed, which drops the pins as well). Idempotent, thread-safe, never raises."""
        with self._lock:
            if self.released:
                return
            self.released = True
            conn, self._conn = self._conn, None
        self.parts = [None] * len(self.keys)
        if conn is None:
            return
        if self._borrow is not None:  # sent ahead of the connection's next request
            conn.defer(release_frame(self._borrow))
        self._give(conn)


def borrow_on(conn, deadline: float, frame: bytes, ns: Namespace, keys: Sequence[ChunkKey],
              take: Callable[[Any], torch.Tensor], give: Callable[[Any], None]
              ) -> ArenaBorrow:
    """One get exchange whose arena chunks stay borrowed: views of their runs (no copy), the
    inline chunks read into ``take(layout)`` tensors. The returned borrow owns ``conn`` (it
    goes back through ``give`` at ``release``). Raises as ``Conn.request``, and
    ``ProtocolError`` for a malformed reply (the caller closes the connection then, which
    drops the pins)."""
    reply = conn.request(frame, deadline)
    chunks, borrow = reply.get("chunks"), reply.get("borrow")
    if not isinstance(chunks, list) or len(chunks) != len(keys):
        raise P.ProtocolError(f"get reply lists {str(chunks)[:40]} for {len(keys)} keys")
    lay, arena = ns.layout, conn.hello.arena
    parts: list[list[torch.Tensor] | None] = []
    inline = 0
    for c in chunks:
        if c is None:
            parts.append(None)
        elif isinstance(c, dict) and "runs" in c:
            whole = arena.tensor()  # [arena bytes], read-only
            parts.append([whole[off:off + n]
                          for off, n in arena.merged_runs(c["runs"], lay.chunk_bytes)])
        elif isinstance(c, dict) and c.get("inline") == lay.chunk_bytes:
            kv = take(lay)
            flat = kv.view(torch.uint8).reshape(-1)  # [chunk_bytes]
            conn.recv_into(memoryview(flat.numpy()), deadline)
            inline += lay.chunk_bytes
            parts.append([flat])
        else:
            raise P.ProtocolError(f"bad get reply entry {str(c)[:60]}: want runs or "
                                  f"inline={lay.chunk_bytes}")
    if inline != reply["payload_bytes"]:
        raise P.ProtocolError(f"get reply carries {reply['payload_bytes']} payload bytes; "
                              f"its inline chunks {inline}")
    return ArenaBorrow(keys, parts, conn, borrow, give)


def copy_on(conn, deadline: float, frame: bytes, ns: Namespace, keys: Sequence[ChunkKey],
            out: Sequence[torch.Tensor] | None,
            take: Callable[[Any], torch.Tensor]) -> list[torch.Tensor | None]:
    """One get exchange: copy each found chunk's arena runs (or read its inline bytes) into
    its destination (``out[i]``, else ``take(layout)``), then release the borrow. Raises as
    ``Conn.request``."""
    reply = conn.request(frame, deadline)
    chunks, borrow = reply.get("chunks"), reply.get("borrow")
    if not isinstance(chunks, list) or len(chunks) != len(keys):
        raise P.ProtocolError(f"get reply lists {str(chunks)[:40]} for {len(keys)} keys")
    lay, arena = ns.layout, conn.hello.arena
    got: list[torch.Tensor | None] = []
    inline = 0
    for i, c in enumerate(chunks):
        if c is None:
            got.append(None)
            continue
        kv = out[i] if out is not None else take(lay)
        dst = kv.view(torch.uint8).reshape(-1).numpy()  # [chunk_bytes]
        if not isinstance(c, dict):
            raise P.ProtocolError(f"bad get reply entry {str(c)[:60]}")
        if "runs" in c:
            arena.copy_runs(c["runs"], dst)
        elif c.get("inline") == lay.chunk_bytes:
            conn.recv_into(memoryview(dst), deadline)
            inline += lay.chunk_bytes
        else:
            raise P.ProtocolError(f"bad get reply entry {str(c)[:60]}: want runs or "
                                  f"inline={lay.chunk_bytes}")
        got.append(kv)
    if inline != reply["payload_bytes"]:
        raise P.ProtocolError(f"get reply carries {reply['payload_bytes']} payload bytes; "
                              f"its inline chunks {inline}")
    if borrow is not None:  # sent ahead of the connection's next request
        conn.defer(release_frame(borrow))
    return got


def release_frame(borrow: Any) -> bytes:
    """The frame of ``release`` for borrow id ``borrow`` (no reply follows)."""
    blob = json.dumps({"op": "release", "borrow": borrow}, separators=(",", ":")).encode()
    return P.PREAMBLE.pack(P.MAGIC, len(blob)) + blob


__all__ = ["ArenaBorrow", "CopiedBorrow", "borrow_on", "copy_on", "release_frame"]
