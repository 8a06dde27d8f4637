"""KV layout of one chunk: shape, dtype and byte size.

A chunk's KV is one contiguous tensor of shape
``[num_layers, 2, chunk_tokens, num_kv_heads, head_dim]`` where index 0 of dim 1 is K and
index 1 is V. ``chunk_tokens == chunk_size`` for every stored chunk (partial trailing chunks
are not stored).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.defaults import DEFAULT_CHUNK_SIZE
from kvstore.ns_wire import wire_layout

#: dtype names accepted in a layout, mapped to torch dtypes. fp8 only where torch has it.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)

_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
            "float": "float32", "fp8": "float8_e4m3fn"}


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical dtype name (``"float16"``...) for a torch dtype or an alias.

    Raises:
        ValueError: the dtype is not supported for KV chunks.
    """
    if isinstance(dtype, torch.dtype):
        for name, dt in DTYPES.items():
            if dt == dtype:
                return name
        raise ValueError(f"unsupported KV dtype {dtype}; supported: {sorted(DTYPES)}")
    name = _ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; supported: {sorted(DTYPES)}")
    return name


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of the KV of one chunk.

    Attributes:
        num_layers: transformer layers.
        num_kv_heads: KV heads per layer (GQA groups).
        head_dim: elements per head.
        dtype: canonical dtype name, e.g. ``"float16"`` (aliases and torch dtypes accepted).
        chunk_size: tokens per chunk (default ``DEFAULT_CHUNK_SIZE``, 256).

    Raises:
        ValueError: a dimension that is not a positive int (a bool is not), or an
            unsupported dtype.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    chunk_size: int = DEFAULT_CHUNK_SIZE

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for field in ("num_layers", "num_kv_heads", "head_dim", "chunk_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{field} must be a positive int, got {value!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.torch_dtype.itemsize

    def shape(self, num_tokens: int | None = None) -> tuple[int, int, int, int, int]:
        """``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` (num_tokens defaults to chunk_size)."""
        t = self.chunk_size if num_tokens is None else num_tokens
        return (self.num_layers, 2, t, self.num_kv_heads, self.head_dim)

    @property
    def token_bytes(self) -> int:
        """Bytes of KV per token over all layers (K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one full chunk."""
        return self.token_bytes * self.chunk_size

    def validate(self, kv: torch.Tensor, num_tokens: int | None = None) -> None:
        """Check a chunk tensor against this layout.

        Raises:
            ValueError: wrong shape or dtype, naming expected and got; a tensor without data
                (on the ``meta`` device), naming the device.
        """
        if not isinstance(kv, torch.Tensor):
            raise ValueError(f"expected a torch.Tensor, got {type(kv).__name__}")
        if kv.device.type == "meta":
            raise ValueError(f"KV tensor on device {kv.device} has no data to store; give a "
                             f"tensor on the CPU or a GPU")
        want = self.shape(num_tokens)
        if tuple(kv.shape) != want:
            raise ValueError(f"KV shape mismatch: expected {list(want)}, got {list(kv.shape)}")
        if kv.dtype != self.torch_dtype:
            raise ValueError(f"KV dtype mismatch: expected {self.torch_dtype}, got {kv.dtype}")

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": self.dtype, "chunk_size": self.chunk_size}

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        """Inverse of ``to_dict`` (dtype aliases accepted); nothing is coerced
        (``kvstore.ns_wire.wire_layout``: ``"30"``, ``30.7`` or ``true`` for a number is
        refused, not read as 30, 30 or 1).

        Raises:
            KeyError: a missing field (``e.args[0]`` names it).
            ValueError: a field a layout does not have, a number that is not a positive int,
                an unsupported dtype; the message names the field.
            TypeError: ``d`` is not a dict.
        """
        return cls(**wire_layout(d))
