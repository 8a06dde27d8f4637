"""The engine's prefix-caching block hash: a chain over full blocks of token ids.

``h[i] = xxh3_128(h[i-1] || tokens of block i)`` with ``h[-1] = seed``; tokens as uint32
little-endian (4 bytes per token). A block's hash names its whole prefix, so two sequences
share block ``i`` exactly when their first ``i + 1`` blocks hold the same tokens (and the seed,
which names the model and dtype, is the same). The hash is the engine's own: the KV store keys
its chunks with its own scheme through the connector.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash


def block_hashes(seed: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes (16 bytes each) of each full ``block_size``-token block of ``token_ids``.

    Args:
        seed: hash of the block before the first (``h[-1]``).
        token_ids: token ids, each in ``[0, 2**32)``; a trailing partial block is left out.
        block_size: tokens per block (> 0).

    Raises:
        ValueError: block_size <= 0, or a token id outside ``[0, 2**32)``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    raw = arr.astype("<u4").tobytes()
    step = 4 * block_size
    out: list[bytes] = []
    prev = seed
    for i in range(len(raw) // step):
        prev = xxhash.xxh3_128_digest(prev + raw[i * step:(i + 1) * step])
        out.append(prev)
    return out
