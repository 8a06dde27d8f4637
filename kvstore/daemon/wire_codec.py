"""The wire codec of the daemon's HTTP get and put bodies: chunk payloads sent encoded with a
lossy codec of ``kvstore.kv_codec`` (``kivi``, ``int8``, ``fp8``: about half of fp16's bytes)
when the client asks. Pure functions, no I/O; part of the wire format
(``kvstore.daemon.protocol``).

A request names its wire codec in the HTTP header ``X-KVStore-Wire-Codec`` (absent or
``raw``: the default, bit-exact payloads, byte for byte the messages without the header):

* ``POST /v1/get``: the daemon sends each found chunk encoded with it; the answer carries the
  header too and each found entry of its binary header ``"codec": NAME``.
* ``POST /v1/put``: the request's payloads are encoded with it, each entry of the binary
  header saying ``"codec": NAME``. The daemon decodes them into the namespace's dtype before
  storing: its memory tiers hold the exact bytes of what was decoded, and every later reader
  (raw or not) gets those values.

In both, an entry's ``nbytes`` and ``xxh3`` are the encoded payload's; ``dtype`` and
``shape`` stay the namespace layout's (the decoded chunk's). An entry may instead say
``"codec": "raw"`` (or nothing) and carry raw bytes: a chunk a lossy codec cannot encode (a
non-finite value) travels exactly.

**The rule (no silent lossy chunk, ``kvstore.kv_codec``):** a lossy wire codec is used only
for a namespace whose ``lossy_codec`` names it. The daemon refuses any other request naming
one with 422, in both directions (nothing is read, stored or sent), and a codec name it does
not know with 400. A client never picks a lossy wire codec by itself
(``AsyncKVStoreClient(wire_codec=...)``).
"""
from __future__ import annotations

import numpy as np
import torch

from kvstore import kv_codec
from kvstore.daemon.fields import ProtocolError
from kvstore.keys import Namespace
from kvstore.layout import KVLayout

WIRE_CODEC_HEADER = "X-KVStore-Wire-Codec"
#: Codec names a request may give: ``raw`` (default) and the lossy codecs.
WIRE_CODECS = ("raw",) + kv_codec.LOSSY_CODECS
#: KV dtypes the lossy codecs encode (other namespaces' chunks always travel raw).
ENCODABLE_DTYPES = ("float32", "float16", "bfloat16")


def parse_wire_codec(value: str | None) -> str:
    """The wire codec an ``X-KVStore-Wire-Codec`` header value names (None: ``raw``).

    Raises:
        ProtocolError(400): a name that is not in ``WIRE_CODECS``.
    """
    if value is None:
        return "raw"
    name = value.strip().lower()
    if name not in WIRE_CODECS:
        raise ProtocolError(f"unknown wire codec {value[:40]!r} in {WIRE_CODEC_HEADER}; "
                            f"choose one of {list(WIRE_CODECS)}")
    return name


def check_accepted(ns: Namespace, codec: str) -> None:
    """Refuse a lossy wire ``codec`` for a namespace that does not accept it (the rule).

    Raises:
        ProtocolError(422): ``codec`` is lossy and ``ns.lossy_codec`` does not name it.
    """
    if codec != "raw" and ns.lossy_codec != codec:
        accepted = repr(ns.lossy_codec) if ns.lossy_codec else "none (bit-exact only)"
        raise ProtocolError(f"wire codec {codec!r} refused: the namespace accepts lossy codec "
                            f"{accepted}; send {WIRE_CODEC_HEADER}: raw or a namespace whose "
                            f"lossy_codec is {codec!r}", 422)


def codec_for(ns: Namespace, wanted: str) -> str:
    """The wire codec a client that wants ``wanted`` (``raw`` or a lossy codec) uses for
    ``ns``: ``wanted`` when ``ns.lossy_codec`` names it and its dtype is encodable, else
    ``raw`` (the rule, as ``kv_codec.chunk_codec`` applies it to tiers)."""
    if ns.layout.dtype not in ENCODABLE_DTYPES:
        return "raw"
    return kv_codec.chunk_codec(wanted, ns.lossy_codec, "raw")


def max_nbytes(codec: str, layout: KVLayout) -> int:
    """Largest payload an entry of ``codec`` may declare for a chunk of ``layout``: the raw
    chunk's bytes for ``raw``, else the larger of those and the codec's payload with fp32
    scales (``kv_codec.payload_nbytes``). A payload's exact size is checked when it is
    decoded."""
    if codec == "raw":
        return layout.chunk_bytes
    return max(layout.chunk_bytes, kv_codec.payload_nbytes(codec, tuple(layout.shape()), 4))


def encode_chunk(kv: torch.Tensor, codec: str) -> tuple[str, memoryview]:
    """``kv`` (``[num_layers, 2, chunk_size, num_kv_heads, head_dim]``, any device) as wire bytes:
    ``(codec, payload)``, or ``("raw", its raw bytes)`` when ``codec`` is ``raw`` or cannot
    encode it (a non-finite value). A new payload for a lossy codec; a view of ``kv`` for raw.
    """
    if codec != "raw":
        try:
            return codec, memoryview(kv_codec.encode(kv, codec))
        except ValueError:  # a non-finite value: the chunk travels exactly
            pass
    kv = kv.detach().to("cpu").contiguous()
    return "raw", memoryview(kv.view(torch.uint8).reshape(-1).numpy())


def decode_chunk(payload, codec: str, layout: KVLayout,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The chunk (layout's dtype and shape ``[L, 2, T, H, D]``) of a wire payload of ``codec``
    (bytes-like, only read), written into ``out`` (a CPU tensor of the layout) when given,
    else a new tensor.

    Raises:
        ProtocolError(400): a payload that does not decode as ``codec`` for this layout (its
            size is not the codec's for the shape, a bad parameter byte).
    """
    shape = tuple(layout.shape())
    if codec == "raw":
        if memoryview(payload).nbytes != layout.chunk_bytes:
            raise ProtocolError(f"raw payload of {memoryview(payload).nbytes} bytes, layout "
                                f"needs {layout.chunk_bytes}")
        flat = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy())
        kv = flat.view(layout.torch_dtype).reshape(shape)
    else:
        try:
            kv = kv_codec.decode(payload, codec, layout.torch_dtype, shape)
        except ValueError as e:
            raise ProtocolError(f"payload does not decode as {codec}: {e}") from None
    if out is None:
        return kv
    out.copy_(kv)
    return out
