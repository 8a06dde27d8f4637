"""Lossy KV codecs on the real model: ``python -m bench.codec [--quick] [--json FILE]``.

Prompts: the long-document and multi-round workloads (``bench.workloads``; 20 prompts, or 3
with ``--quick``; ``--seed`` draws another set), on engine_min with the embedded SmolLM2-135M-Instruct, its prefix cache off
(reuse comes from the store only). Per prompt, greedy, ``--max-tokens`` (32) generated tokens:

* ``recompute``: no connector (full prefill);
* per codec (``raw``, ``int8``, ``fp8``, ``kivi``): a store with a disk tier only, configured with that
  codec, and a connector whose namespace accepts it (``lossy_codec``; none for ``raw``), full
  chunks only (no tail pieces: the prompt's last partial chunk is prefilled). The raw run
  saves each prompt's chunks with a first request; a lossy codec's store gets the same
  chunks (read back from the raw store, bit-exact) put under its own namespace's keys, which
  its disk tier encodes (one prefill less per prompt and codec). Once they are on disk
  (``flush``), a request loads the prefix from the disk tier (decoded) and generates
  (prompt + generated chunks are not saved). ``disk_hit_ttft_s`` is its
  TTFT (median; the value's pages are in the OS page cache: the decode, not the device, is
  measured); ``token_agreement`` is the fraction of the generated tokens equal to
  recompute's at the same position (mean over prompts; per prompt in
  ``token_agreement_per_prompt``), ``prompt_exact_rate`` the fraction
  of prompts whose generated tokens all equal recompute's.

``--cold``: then, per codec, disk hits timed with the tier's data file out of the page cache
and in it, the codecs alternated (``--ttft-rounds`` rounds; each round takes every prompt,
codecs in turn, the order reversed every round): before each cold hit the disk tier's
``data.mdb`` is evicted from the page cache (``bench.page_cache.drop``; what stayed resident
is recorded), the hit generates one token (TTFT), and the same hit again is the warm one.
``disk_hit_ttft_cold_s`` / ``disk_hit_ttft_warm_s``: medians; ``*_runs_s``: every run;
``cold_resident_bytes_max``: the most of the data file still cached after an eviction (0: it
worked).

Codec figures over the chunks the raw run stored (the model's real KV, fp32 in engine_min; up
to 48 full chunks, ``chunks_measured``, ``first_chunks_measured`` of them a prompt's first):
``bytes_ratio_vs_fp16`` (stored value bytes of those chunks, header and scales counted, / 2
bytes per element: a mix of the two kinds below, so it depends on the prompts' lengths: about
0.51 for kivi in ``--quick``'s 3 short prompts, 0.488 in the full run),
``bytes_ratio_vs_fp16_next_chunk`` (the same over the chunks with a parent, every chunk of a
prompt but its first: kivi's 0.484, the per-chunk figure the README quotes),
``bytes_ratio_vs_fp16_first_chunk`` (over the prompts' first chunks: kivi keeps their first
``kvstore.kv_codec.SINK_TOKENS`` tokens in fp16, 0.547; None when none was sampled),
``bytes_ratio_vs_stored_dtype`` (/ the KV dtype's bytes), ``max_abs_error`` and
``mean_abs_error`` of the decoded KV, ``within_error_bound`` (every decoded value within the
codec's stated bound, ``kvstore.kv_codec.error_bound``), ``encode_gbps`` / ``decode_gbps`` (fp16-equivalent
bytes per second of ``kvstore.codec.pack_value`` / ``unpack_value``: a tier's whole
per-chunk cost, checksums included; for a lossy codec packing also decodes once, for the
checksum). ``wire_get_gbps``: fp16-equivalent bytes per second of gets of those chunks
from a local daemon (``kvstore serve``'s app on a loopback port, a CPU tier) by a client
whose wire codec is the codec (``KVStoreClient(wire_codec=...)``: the daemon encodes, the
client decodes; ``raw`` moves exact bytes), batches of 8 chunks, best of 3 passes;
``wire_bytes_ratio_vs_fp16`` is the payload bytes the daemon sent per fp16 byte (the wire's
encoding, sent as the chunks are read: not the disk tier's stored values above).
``load_average`` is recorded: figures on a busy host are not comparable.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

if __name__ == "__main__":  # run as a script: before torch loads OpenMP
    from engine_min.omp import set_omp_wait_policy
    set_omp_wait_policy()
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.report import emit_json  # noqa: E402
from bench.workloads import LongDocQA, MultiRoundQA  # noqa: E402
from kvstore import kv_codec  # noqa: E402
from kvstore.codec import pack_value, unpack_value  # noqa: E402
from kvstore.layout import dtype_name  # noqa: E402
from bench.arg_checks import chunk_size, int_at_least  # noqa: E402
from bench.outputs import output_file  # noqa: E402

CODECS = ("raw", "int8", "fp8", "kivi")


def workload_prompts(quick: bool, seed: int = 0) -> list[list[int]]:
    """Token prompts: long-document questions, then multi-round chat prompts (``seed``: the
    workloads' seed, another seed gives another prompt set of the same shape)."""
    if quick:
        docs = LongDocQA(num_docs=1, doc_tokens=192, questions_per_doc=2, question_tokens=16,
                         seed=seed)
        chat = MultiRoundQA(num_users=1, num_rounds=1, system_tokens=32, context_tokens=128,
                            question_tokens=16, answer_tokens=8, seed=seed)
    else:
        docs = LongDocQA(num_docs=2, doc_tokens=1024, questions_per_doc=5, question_tokens=24,
                         seed=seed)
        chat = MultiRoundQA(num_users=5, num_rounds=2, system_tokens=64, context_tokens=512,
                            question_tokens=24, answer_tokens=32, seed=seed)
    return [list(r.prompt) for r in docs.requests() + chat.requests()]


def _generate(engine, prompt: list[int], max_tokens: int):
    from engine_min.sampler import SamplingParams
    out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
    return out.first_token_time - out.arrival_time, list(out.output_token_ids)


def run_codec(engine, codec: str, prompts, want, args, workdir: str, source=None) -> tuple:
    """Hits from a disk tier of ``codec``; ``source`` = the raw run's (store, namespace), whose
    chunks are put into this codec's store (None: this is the raw run, a first request saves
    them). Returns (figures, store, connector): both open, the caller closes them."""
    from connectors.engine_min import EngineMinConnector
    from kvstore.config import StoreConfig
    from kvstore.store import ChunkStore

    cfg = StoreConfig(cpu_bytes=0, disk_bytes="4GiB", disk_path=os.path.join(workdir, codec),
                      disk_codec=codec)
    store = ChunkStore(cfg)
    conn = EngineMinConnector(store, chunk_size=args.chunk_size, deadline_s=30.0,
                              deadline_s_per_chunk=1.0, save_generated=False, owns_store=False,
                              tail_chunk_size=0, lossy_codec="" if codec == "raw" else codec)
    agree, exact, ttft, loaded = [], [], [], 0
    ok = False
    try:
        for p, w in zip(prompts, want):
            engine.set_connector(conn)
            if source is None:
                _generate(engine, p, 1)                          # saves the prompt's chunks
                conn.wait_for_save(120)
            else:
                src_store, src_ns = source
                kvs = src_store.get_chunks(src_ns, src_ns.chunk_keys(p))
                store.put_chunks(conn.ns, conn.ns.chunk_keys(p), kvs)
            store.flush(120)
            before = engine.stats()["kvstore_loaded_tokens"]
            t, got = _generate(engine, p, args.max_tokens)        # loads them from disk
            loaded += engine.stats()["kvstore_loaded_tokens"] - before
            engine.set_connector(None)
            same = [a == b for a, b in zip(got, w)]
            agree.append(sum(same) / len(w))
            exact.append(got == w)
            ttft.append(t)
        ok = True
    finally:
        engine.set_connector(None)
        if not ok:
            conn.close()
            store.close()
    res = {"token_agreement": statistics.mean(agree), "prompt_exact_rate": statistics.mean(exact),
           "token_agreement_per_prompt": agree,
           "disk_hit_ttft_s": statistics.median(ttft), "disk_hit_ttft_runs_s": ttft,
           "loaded_tokens": loaded}
    return res, store, conn


def ttft_rounds(engine, opened: dict, prompts, rounds: int) -> dict:
    """Cold and warm disk-hit TTFTs per codec (module docstring, ``--cold``); ``opened``:
    ``{codec: (store, connector)}`` whose disk tiers hold every prompt's chunks."""
    from bench import page_cache

    codecs = list(opened)
    runs = {c: {"cold": [], "warm": []} for c in codecs}
    resident = {c: 0 for c in codecs}
    for r in range(rounds):
        for p in prompts:
            for codec in (codecs if r % 2 == 0 else codecs[::-1]):
                store, conn = opened[codec]
                data = os.path.join(store.tiers[-1].path, "data.mdb")
                engine.set_connector(conn)
                try:
                    page_cache.drop(data)
                    resident[codec] = max(resident[codec], page_cache.resident_bytes(data)[0])
                    runs[codec]["cold"].append(_generate(engine, p, 1)[0])
                    runs[codec]["warm"].append(_generate(engine, p, 1)[0])
                finally:
                    engine.set_connector(None)
    return {c: {"disk_hit_ttft_cold_s": statistics.median(runs[c]["cold"]),
                "disk_hit_ttft_warm_s": statistics.median(runs[c]["warm"]),
                "disk_hit_ttft_cold_runs_s": runs[c]["cold"],
                "disk_hit_ttft_warm_runs_s": runs[c]["warm"],
                "cold_resident_bytes_max": resident[c],
                "data_file_bytes": os.path.getsize(os.path.join(opened[c][0].tiers[-1].path,
                                                                "data.mdb"))}
            for c in codecs}


def _stored_chunks(store, chunk_size: int, limit: int = 48
                   ) -> tuple[list[torch.Tensor], list[bool]]:
    """Up to ``limit`` full chunks (``chunk_size`` tokens, not tail pieces) of the disk tier
    (exact KV: the raw run's), and for each whether it is a prompt's first chunk (no parent:
    ``kivi`` keeps its attention-sink tokens)."""
    disk = store.tiers[-1]
    kvs, first = [], []
    for k in disk.keys():
        kv = disk.read(k)
        if kv is not None and kv.shape[2] == chunk_size and len(kvs) < limit:
            kvs.append(kv)
            first.append(disk.parent_of(k) is None)
    return kvs, first


def codec_figures(kvs: list[torch.Tensor], codec: str, first: list[bool] | None = None) -> dict:
    """Bytes, error and speed of ``codec`` over real chunks ``kvs``, packed as a tier packs
    them: ``first[i]`` says chunk i is a prompt's first (packed with no parent; default:
    none is)."""
    key, parent = bytes(48), bytes(48)
    first = first or [False] * len(kvs)
    elems = sum(kv.numel() for kv in kvs)
    stored, enc_s, dec_s, max_err, sum_err, over = 0, 0.0, 0.0, 0.0, 0.0, 0.0
    by_kind = {True: [0, 0], False: [0, 0]}  # first chunk or not -> [stored bytes, elements]
    for kv, is_first in zip(kvs, first):
        raw = kv.reshape(-1).view(torch.uint8).numpy()
        sinks = kv_codec.SINK_TOKENS if codec == "kivi" and is_first else 0
        t0 = time.perf_counter()
        value = pack_value(key, None if is_first else parent, raw, dtype_name(kv.dtype),
                           tuple(kv.shape), codec)
        t1 = time.perf_counter()
        h, out = unpack_value(value, key)
        t2 = time.perf_counter()
        enc_s, dec_s, stored = enc_s + t1 - t0, dec_s + t2 - t1, stored + len(value)
        by_kind[is_first][0] += len(value)
        by_kind[is_first][1] += kv.numel()
        assert h.codec == codec, (h.codec, codec)
        got = torch.from_numpy(out).view(kv.dtype).view(kv.shape).float()
        err = (got - kv.float()).abs()
        if codec in kv_codec.LOSSY_CODECS:   # the stated bound + half an ulp of the KV dtype
            ulp = torch.finfo(kv.dtype).eps / 2
            bound = kv_codec.error_bound(kv, codec, sinks)
            over = max(over, float((err - bound - got.abs() * ulp).max()))
        max_err, sum_err = max(max_err, float(err.max())), sum_err + float(err.sum(dtype=torch.float64))
    first_ratio, next_ratio = (by_kind[k][0] / (2 * by_kind[k][1]) if by_kind[k][1] else None
                               for k in (True, False))
    return {"bytes_ratio_vs_fp16": stored / (2 * elems),
            "bytes_ratio_vs_fp16_next_chunk": next_ratio,
            "bytes_ratio_vs_fp16_first_chunk": first_ratio,
            "bytes_ratio_vs_stored_dtype": stored / (kvs[0].element_size() * elems),
            "max_abs_error": max_err, "mean_abs_error": sum_err / elems,
            "kv_abs_max": max(float(kv.abs().max()) for kv in kvs),
            "encode_gbps": 2 * elems / enc_s / 1e9, "decode_gbps": 2 * elems / dec_s / 1e9,
            "chunks_measured": len(kvs), "first_chunks_measured": sum(first),
            "within_error_bound": over <= 0}


def wire_figures(kvs: list[torch.Tensor], codecs: list[str], batch: int = 8,
                 passes: int = 3) -> dict:
    """Per codec, ``{wire_get_gbps, wire_bytes_ratio_vs_fp16}`` of gets of ``kvs`` (real
    chunks ``[L, 2, T, H, D]``) from a local daemon with that wire codec (module docstring)."""
    import re

    from kvstore.config import StoreConfig
    from kvstore.daemon.client import KVStoreClient
    from kvstore.daemon.server import ThreadedServer, create_app
    from kvstore.keys import Namespace
    from kvstore.layout import KVLayout
    from kvstore.store import ChunkStore

    L, _, T, H, D = kvs[0].shape
    layout = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype=dtype_name(kvs[0].dtype),
                      chunk_size=T)
    elems, total = sum(kv.numel() for kv in kvs), sum(kv.numel() * kv.element_size() for kv in kvs)
    store = ChunkStore(StoreConfig(cpu_bytes=len(codecs) * total + (64 << 20)))
    out: dict = {}
    try:
        with ThreadedServer(create_app(store)) as srv, \
                KVStoreClient(srv.url, same_host=False, timeout_s=120.0) as admin:
            def sent() -> float:
                m = re.search(r"^kvstore_server_sent_bytes_total ([0-9.e+]+)$",
                              admin.metrics_text(), re.M)
                return float(m.group(1)) if m else 0.0
            for codec in codecs:
                ns = Namespace("bench-wire", layout, lossy_codec="" if codec == "raw" else codec)
                keys = ns.chunk_keys(range(T * len(kvs)))
                admin.put_chunks(ns, keys, kvs)
                with KVStoreClient(srv.url, same_host=False, timeout_s=120.0,
                                   wire_codec=codec) as c:
                    best, before = float("inf"), sent()
                    for _ in range(passes):
                        t0 = time.perf_counter()
                        for i in range(0, len(keys), batch):
                            got = c.get_chunks(ns, keys[i:i + batch])
                            assert all(g is not None for g in got)
                        best = min(best, time.perf_counter() - t0)
                    nbytes = (sent() - before) / passes
                out[codec] = {"wire_get_gbps": 2 * elems / best / 1e9,
                              "wire_bytes_ratio_vs_fp16": nbytes / (2 * elems)}
    finally:
        store.close()
    return out


_DURATION = ("Duration on the 2-core machine: --quick (3 prompts of about 200 tokens) 49 s wall\n"
             "(nice 19, load average 2.4-5.0 from other work, 2026-12-02); the default run (20\n"
             "prompts of 600-1,048 tokens) was not timed: many times --quick's model work.")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(epilog=_DURATION,
                                 prog="python -m bench.codec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 short prompts (a smoke run)")
    ap.add_argument("--max-tokens", type=int_at_least(1), default=32,
                    help="generated tokens per prompt (>= 1)")
    ap.add_argument("--chunk-size", type=chunk_size, default=64,
                    help="store chunk size, a multiple of the engine's block size 16 (default "
                    "%(default)s: a hit prefills < 64 tokens)")
    ap.add_argument("--codecs", default=",".join(CODECS), help="comma-separated, raw first")
    ap.add_argument("--seed", type=int_at_least(0), default=0,
                    help="workload seed (another prompt set; default %(default)s)")
    ap.add_argument("--cold", action="store_true",
                    help="also time disk hits with the data file evicted from the page cache "
                    "and cached, codecs alternated (module docstring)")
    ap.add_argument("--ttft-rounds", type=int_at_least(1), default=3,
                    help="rounds of cold/warm hits with --cold (default %(default)s)")
    ap.add_argument("--json", default=None, type=output_file, help="write the figures here")
    args = ap.parse_args(argv)
    codecs = args.codecs.split(",")
    if codecs[0] != "raw" or not set(codecs) <= set(CODECS):
        ap.error(f"--codecs must start with raw and name only {CODECS}")
    load_start = os.getloadavg()[0]

    from engine_min.config import EngineConfig
    from engine_min.engine import LLMEngine

    prompts = workload_prompts(args.quick, args.seed)
    n = max(len(p) for p in prompts) + args.max_tokens + 16
    cfg = EngineConfig(kv_cache_bytes=(n + 64) * 30 * 2 * 3 * 64 * 4 * 2,
                       enable_prefix_caching=False, max_num_batched_tokens=max(512, n))
    engine = LLMEngine(cfg)
    _generate(engine, prompts[0][:64], 2)                        # warm-up
    rec_ttft, want = [], []
    for p in prompts:
        t, out = _generate(engine, p, args.max_tokens)
        rec_ttft.append(t)
        want.append(out)
    res: dict = {"num_prompts": len(prompts), "seed": args.seed, "prompt_tokens": [len(p) for p in prompts],
                 "max_tokens": args.max_tokens, "chunk_size": args.chunk_size,
                 "recompute_ttft_s": statistics.median(rec_ttft), "codecs": {}}
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-codec-") as workdir:
        source, opened = None, {}
        try:
            for codec in codecs:
                row, store, conn = run_codec(engine, codec, prompts, want, args, workdir, source)
                res["codecs"][codec] = row
                opened[codec] = (store, conn)
                if source is None:
                    source = (store, conn.ns)
            if args.cold:
                for codec, row in ttft_rounds(engine, opened, prompts, args.ttft_rounds).items():
                    res["codecs"][codec].update(row)
            kvs, first = _stored_chunks(source[0], args.chunk_size)
        finally:
            for store, conn in opened.values():
                conn.close()
                store.close()
    res["kv_dtype"] = str(kvs[0].dtype).removeprefix("torch.")
    for codec in codecs:
        res["codecs"][codec].update(codec_figures(kvs, codec, first))
    for codec, row in wire_figures(kvs, codecs).items():
        res["codecs"][codec].update(row)
    res["load_average"] = [load_start, os.getloadavg()[0]]
    return emit_json(res, args.json)


if __name__ == "__main__":
    main()
