"""Writes ``kv_codec_v1.npz`` / ``kv_codec_v2.npz``: chunks and their lossy payloads with the
checksum of each payload's decoded bytes, as the encoder of the time produced them (kept so a
later encoder or decoder can be checked bit for bit against payloads already stored). v1:
``int8``, ``fp8`` and ``kivi`` with V asymmetric (``V1_KIVI_PARAMS``); v2: ``kivi`` with
today's ``KIVI_PARAMS`` (V symmetric). Run from the repository root:
``python tests/kvstore/data/make_kv_codec_fixture.py v1|v2``.
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.getcwd())
from kvstore import kv_codec, kv_grouped  # noqa: E402
from kvstore.codec import checksum  # noqa: E402

#: ``kivi``'s parameters in v1 payloads: V at 7 bits with a minimum and a step per group.
V1_KIVI_PARAMS = kv_grouped.GroupParams(k=kv_grouped.PartParams(8, 64, "tokens", symmetric=True),
                                        v=kv_grouped.PartParams(7, 64, "channels"))
VERSIONS = {"v1": (kv_codec.LOSSY_CODECS, V1_KIVI_PARAMS), "v2": (("kivi",), None)}


def cases() -> dict[str, torch.Tensor]:
    """Named chunks: a real-shaped one with outlier key channels (fp32), odd shapes (a last
    group shorter than 64, fp16 and bf16), and special values (an all-zero group, -0.0, values
    in fp8's subnormal range, values too large for fp16 scales)."""
    g = np.random.default_rng(18)
    out = {}
    x = g.standard_normal((1, 2, 64, 2, 64), dtype=np.float32)
    x[:, 0] *= 0.5 + 7.5 * g.random((1, 1, 2, 64), dtype=np.float32) ** 4
    out["real_f32"] = torch.from_numpy(x)
    out["odd_f16"] = torch.from_numpy(g.standard_normal((2, 2, 67, 3, 40), dtype=np.float32)).half()
    out["odd_bf16"] = torch.from_numpy(3 * g.standard_normal((1, 2, 70, 1, 72),
                                                             dtype=np.float32)).bfloat16()
    s = g.standard_normal((2, 2, 16, 2, 8), dtype=np.float32)
    s[0, :, :, 0] = 0.0                                        # all-zero groups
    s[0, :, 3, 1] = -0.0
    s[1, :, :, 1, 1:] *= 1e-5                                  # fp8 subnormals, tiny steps
    out["special_f32"] = torch.from_numpy(s)
    out["big_f32"] = torch.from_numpy(s * np.float32(3e7))     # fp32 scales
    return out


def main(version: str) -> None:
    codecs, kivi_params = VERSIONS[version]
    if kivi_params is not None:
        kv_codec.KIVI_PARAMS = kivi_params
    arrays = {}
    for name, kv in cases().items():
        arrays[f"{name}.input"] = kv.reshape(-1).view(torch.uint8).numpy()
        arrays[f"{name}.dtype"] = np.array(str(kv.dtype).removeprefix("torch."))
        arrays[f"{name}.shape"] = np.array(kv.shape, dtype=np.int64)
        for codec in codecs:
            payload = kv_codec.encode(kv, codec)
            dec = kv_codec.decode(payload, codec, kv.dtype, tuple(kv.shape))
            arrays[f"{name}.{codec}.payload"] = np.asarray(payload, dtype=np.uint8)
            arrays[f"{name}.{codec}.decoded_xxh3"] = np.array(
                checksum(dec.reshape(-1).view(torch.uint8).numpy()), dtype=np.uint64)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"kv_codec_{version}.npz")
    np.savez_compressed(path, **arrays)
    print(path, os.path.getsize(path))


if __name__ == "__main__":
    main(sys.argv[1])
