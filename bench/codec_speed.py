"""Encode/decode speed of the lossy KV codecs on one real-shaped chunk:
``python -m bench.codec_speed [--shape L,T,H,D] [--dtype float32] [--repeat N] [--json FILE]``.

The chunk is ``[L, 2, T, H, D]`` (default 30, 64, 3, 64: engine_min's SmolLM2-135M at chunk
size 64, fp32), normal values with per-channel key scales (keys' outlier channels), seeded.
Per codec, GB/s of fp16-equivalent bytes (2 bytes per element) of:

* ``encode_gbps`` / ``decode_gbps``: ``kvstore.kv_codec.encode`` / ``decode`` alone;
* ``pack_gbps`` / ``unpack_gbps``: ``kvstore.codec.pack_value`` / ``unpack_value`` (a tier's
  whole per-chunk cost: checksums, and for a lossy codec packing decodes once too);
* ``disk_read_gbps``: ``DiskTier.read`` of the committed chunk (lmdb pages in the OS page
  cache: header and checksum checks, decode).

Each ``*_gbps`` is of the median process CPU time (all threads; time spent waiting for a
core on a busy host is not counted) of ``--repeat`` runs (default 20), ``*_wall_best_gbps``
of the best wall time; ``load_average`` is recorded: figures on a busy host are noisy.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from bench.report import emit_json
from kvstore import kv_codec
from kvstore.codec import pack_value, unpack_value
from kvstore.layout import dtype_name
from bench.outputs import output_file

CODECS = ("raw",) + kv_codec.LOSSY_CODECS


def make_chunk(shape: tuple[int, int, int, int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A chunk ``[L, 2, T, H, D]`` of ``dtype``: N(0, 1) values, keys scaled per channel by
    0.5-8 (outlier channels), values by 1."""
    L, T, H, D = shape
    g = np.random.default_rng(seed)
    x = g.standard_normal((L, 2, T, H, D), dtype=np.float32)
    x[:, 0] *= (0.5 + 7.5 * g.random((L, 1, H, D), dtype=np.float32) ** 4)
    return torch.from_numpy(x).to(dtype)


def _times(fn, repeat: int) -> tuple[list[float], list[float]]:
    """(wall seconds, process CPU seconds) of ``repeat`` calls of ``fn``."""
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def codec_speed(kv: torch.Tensor, codec: str, repeat: int) -> dict:
    """Figures of ``codec`` on ``kv`` (module docstring)."""
    from kvstore.keys import ChunkKey
    from kvstore.tiers.disk import DiskTier

    fp16_bytes = 2 * kv.numel()
    raw = kv.reshape(-1).view(torch.uint8).numpy()
    key = bytes(48)
    shape, dt = tuple(kv.shape), dtype_name(kv.dtype)
    runs = {}
    if codec != "raw":
        payload = kv_codec.encode(kv, codec)
        runs["encode"] = _times(lambda: kv_codec.encode(kv, codec), repeat)
        runs["decode"] = _times(lambda: kv_codec.decode(payload, codec, kv.dtype, shape), repeat)
    value = pack_value(key, None, raw, dt, shape, codec)
    runs["pack"] = _times(lambda: pack_value(key, None, raw, dt, shape, codec), repeat)
    runs["unpack"] = _times(lambda: unpack_value(value, key), repeat)
    with tempfile.TemporaryDirectory(prefix="kvstore-codec-speed-") as d:
        tier = DiskTier(d, 1 << 30, codec=codec)
        tier.lossy_codec_of = lambda ns_id: codec
        ck = ChunkKey(bytes(16), bytes(32))
        tier.put(ck, kv, None)
        tier.flush(60)
        got = tier.read(ck)
        assert got is not None and got.dtype == kv.dtype and tuple(got.shape) == shape
        runs["disk_read"] = _times(lambda: tier.read(ck), repeat)
        tier.close()
    res = {"bytes_ratio_vs_fp16": len(value) / fp16_bytes}
    for name, (wall, cpu) in runs.items():
        res[f"{name}_gbps"] = fp16_bytes / statistics.median(cpu) / 1e9
        res[f"{name}_wall_best_gbps"] = fp16_bytes / min(wall) / 1e9
    return res


_DURATION = ("Duration on the 2-core machine: the default run (--repeat 20) 6 s wall (nice 19,\n"
             "load average 2.4-5.0 from other work, 2026-12-02).")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(epilog=_DURATION,
                                 prog="python -m bench.codec_speed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="30,64,3,64", help="L,T,H,D (default %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--codecs", default=",".join(CODECS), help="comma-separated")
    ap.add_argument("--repeat", type=int, default=20, help="runs per figure (best and median)")
    ap.add_argument("--json", default=None, type=output_file, help="write the figures here")
    args = ap.parse_args(argv)
    try:
        shape = tuple(int(v) for v in args.shape.split(","))
    except ValueError:
        shape = ()
    codecs = args.codecs.split(",")
    if len(shape) != 4 or min(shape) < 1:
        ap.error(f"--shape must be 4 positive integers L,T,H,D, got {args.shape!r}")
    if not set(codecs) <= set(CODECS):
        ap.error(f"--codecs must name only {CODECS}")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    kv = make_chunk(shape, getattr(torch, args.dtype))
    load_start = os.getloadavg()[0]
    res = {"shape": list(kv.shape), "dtype": args.dtype, "repeat": args.repeat,
           "torch_threads": torch.get_num_threads(),
           "codecs": {c: codec_speed(kv, c, args.repeat) for c in codecs}}
    res["load_average"] = [load_start, os.getloadavg()[0]]
    return emit_json(res, args.json)


if __name__ == "__main__":
    main()
