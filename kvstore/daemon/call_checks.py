"""The checks both paths of the daemon's client (``kvstore.daemon.shm_client`` and
``kvstore.daemon.async_client``) make on a call's arguments before sending anything, so a bad
argument is the same ``ValueError`` over the Unix socket and over HTTP."""
from __future__ import annotations

from typing import Sequence

import torch

from kvstore.daemon import protocol as P
from kvstore.keys import ChunkKey, Namespace


def check_put(ns: Namespace, keys: Sequence[ChunkKey], kvs: Sequence[torch.Tensor],
              parents: Sequence | None) -> None:
    """The checks a client makes on a put before sending anything.

    Raises:
        ValueError: a key that is not a ``ChunkKey``, ``len(keys) != len(kvs)``, a
            ``parents`` of another length, or a tensor not matching ``ns.layout``
            (``KVLayout.validate``).
    """
    P.check_key_types(keys)
    if len(keys) != len(kvs):
        raise ValueError(f"{len(keys)} keys but {len(kvs)} tensors")
    if parents is not None and len(parents) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(parents)} parents")
    for kv in kvs:
        ns.layout.validate(kv)


def check_out(ns: Namespace, keys: Sequence[ChunkKey], out: Sequence[torch.Tensor]) -> None:
    """The checks a client makes on a get's ``out`` buffers before sending anything.

    Raises:
        ValueError: ``len(out) != len(keys)``, or a tensor that is not a contiguous CPU
            tensor of ``ns.layout``'s shape ``[num_layers, 2, chunk_size, num_kv_heads,
            head_dim]`` and dtype.
    """
    if len(out) != len(keys):
        raise ValueError(f"get_chunks: {len(keys)} keys but {len(out)} out tensors")
    lay = ns.layout
    for t in out:
        if (tuple(t.shape) != lay.shape() or t.dtype != lay.torch_dtype
                or t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError(f"get_chunks: each out tensor must be a contiguous CPU "
                             f"{lay.dtype} tensor of shape {list(lay.shape())}, got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")

