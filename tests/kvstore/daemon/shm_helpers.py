"""Shared pieces of the same-host path's daemon tests (``test_shm_server*``): a real daemon over
a ChunkStore with a shared CPU arena (``ThreadedServer(..., unix_socket=)``) and a minimal
blocking client built from ``kvstore.daemon.shm_protocol``'s functions alone, so the daemon's
side is tested against the contract, not against the real client.

Tiny layout: 2 layers, 1 KV head, head_dim 8, fp16, chunk_size 4 -> 256-byte chunks, 256-byte
pages (one page per chunk).
"""
import contextlib
import mmap
import os
import socket
import time

import numpy as np
import torch

from kvstore.config import StoreConfig
from kvstore.daemon import protocol as P
from kvstore.daemon import shm_protocol as S
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.store import ChunkStore
from tests.kvstore.daemon.server_helpers import LAYOUT, NS, OTHER, chunk  # noqa: F401

CB = LAYOUT.chunk_bytes  # 256
KEYS = NS.chunk_keys(list(range(4 * 8)))  # 8 chained chunk keys


def make_store(cpu_bytes: int = 16 * CB, **kw) -> ChunkStore:
    """A ChunkStore whose CPU tier is a shared arena of ``cpu_bytes`` (256-byte pages)."""
    return ChunkStore(StoreConfig(cpu_bytes=cpu_bytes, page_bytes=256, cpu_shared=True, **kw))


@contextlib.contextmanager
def shm_daemon(tmp_path, store=None, **limits):
    """A ThreadedServer with the same-host path on ``tmp_path/kv.sock``; yields it with
    ``.store`` and ``.sock_path`` set. Closes the store at the end."""
    store = store or make_store()
    srv = ThreadedServer(create_app(store, ServerLimits(**limits)),
                         unix_socket=str(tmp_path / "kv.sock"))
    srv.store, srv.sock_path = store, str(tmp_path / "kv.sock")
    try:
        yield srv
    finally:
        srv.stop()
        store.close()


class RawClient:
    """One blocking connection speaking the shm protocol frame by frame."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.arena_fd: int | None = None
        self.arena = None  # read-only mmap
        self.hello_reply: dict | None = None

    def send(self, header: dict, payload: bytes = b"") -> None:
        self.sock.sendall(S.encode_frame(header, len(payload)) + payload)

    def recv(self, fds: list | None = None) -> tuple[dict, bytes]:
        """The next reply and its payload bytes."""
        reply, n = S.recv_frame(self.sock, fds)
        return reply, bytes(S.recv_exact(self.sock, n)) if n else b""

    def call(self, header: dict, payload: bytes = b"") -> tuple[dict, bytes]:
        self.send(header, payload)
        return self.recv()

    def hello(self, token: str | None = None, map_arena: bool = True) -> dict:
        fds: list[int] = []
        self.send({"op": "hello", "version": S.SHM_VERSION, "token": token})
        reply, _ = self.recv(fds)
        self.hello_reply = reply
        if fds:
            self.arena_fd = fds[0]
            if map_arena and reply.get("arena_bytes"):
                self.arena = mmap.mmap(self.arena_fd, reply["arena_bytes"],
                                       flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        return reply

    def keys_op(self, op: str, keys, ns=NS, **extra) -> dict:
        return self.call({"op": op, "namespace": ns.to_dict(), "keys": [k.hex() for k in keys],
                          **extra})[0]

    def put(self, keys, kvs, ns=NS, corrupt: int | None = None) -> dict:
        """Put ``kvs`` under ``keys`` (``corrupt``: flip a byte of that chunk after hashing)."""
        parts = [P.entry_for(k, kv) for k, kv in zip(keys, kvs)]
        payload = bytearray(b"".join(bytes(v) for _, v in parts))
        if corrupt is not None:
            payload[corrupt * CB + 3] ^= 0xFF
        header = {"op": "put", "namespace": ns.to_dict(), "chunks": [e.to_dict() for e, _ in parts]}
        return self.call(header, bytes(payload))[0]

    def get(self, keys, ns=NS) -> tuple[dict, list[bytes | None]]:
        """A get's reply and each chunk's bytes (copied from the arena or inline); the
        borrow is left for the caller to release."""
        reply, inline = self.call({"op": "get", "namespace": ns.to_dict(),
                                   "keys": [k.hex() for k in keys]})
        out, pos = [], 0
        for c in reply.get("chunks") or []:
            if c is None:
                out.append(None)
            elif "runs" in c:
                out.append(b"".join(self.arena[o:o + n] for o, n in c["runs"]))
            else:
                out.append(inline[pos:pos + c["inline"]])
                pos += c["inline"]
        return reply, out

    def release(self, borrow: int) -> None:
        self.send({"op": "release", "borrow": borrow})

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
        if self.arena_fd is not None:
            os.close(self.arena_fd)
        self.sock.close()


def as_bytes(kv: torch.Tensor) -> bytes:
    return kv.contiguous().view(torch.uint8).numpy().tobytes()


def num_pinned(store: ChunkStore) -> int:
    """Chunks holding any pin (``stats()["num_pinned_chunks"]``)."""
    return store.stats()["num_pinned_chunks"]


def wait_until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def arena_array(client: RawClient) -> np.ndarray:
    return np.frombuffer(client.arena, dtype=np.uint8)
