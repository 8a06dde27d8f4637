"""kernels/triton_attention.py's kernels (reshape-and-cache, paged decode) in Triton's
interpreter on CPU tensors against kernels/reference.py, and every Triton kernel of kernels/
compiled for a Hopper GPU (sm_90) on this machine, with no GPU: the same checks as the
``gpu``-marked tests, on every machine."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_attention_kernels_match_reference_in_the_interpreter():
    """Decode within 1e-5 (float32) for three head layouts; reshape-and-cache equal, 21 slots
    written. In a process of its own started with TRITON_INTERPRET=1 (triton_interp)."""
    code = ("import json; from tests.kernels.triton_interp import attention_vs_reference as f; "
            "print(json.dumps(f()))")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(res["decode"]) == {"9-3-64-16", "8-8-32-16", "4-1-80-8"}
    for case, err in res["decode"].items():
        assert err <= 1e-5, (case, err)
    assert res["reshape_and_cache"] is True and res["written"] == 21


def _compile(fn, signature: dict, constexprs: dict):
    """``fn`` compiled for sm_90 with every pointer and integer argument 16-divisible (as
    Triton specializes aligned arguments at launch): its PTX."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
             if t.startswith("*") or t in ("i32", "i64")}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"enable_fp_fusion": True}).asm    # launches' default


@pytest.mark.parametrize("src_ids", [True, False])
def test_block_copy_kernel_compiles_to_16_byte_accesses(src_ids):
    from kernels import triton_cache
    sig = {"src_ptr": "*i16", "dst_ptr": "*i16", "src_ids_ptr": "*i64", "dst_ids_ptr": "*i64",
           **{f"{s}_stride_{d}": "i64" for s in ("src", "dst") for d in ("l", "kv", "b")},
           "block_numel": "i32", "SRC_IDS": "constexpr", "DST_IDS": "constexpr",
           "TILE": "constexpr"}
    asm = _compile(triton_cache._copy_blocks_kernel, sig,
                   {"SRC_IDS": src_ids, "DST_IDS": not src_ids, "TILE": 4096})
    ops = set(re.findall(r"\b(ld|st)\.global\.(v4\.b32|b64|b32)", asm["ptx"]))
    assert ("ld", "v4.b32") in ops and ("st", "v4.b32") in ops      # the KV moves 16 B at a time
    assert ("ld", "b64") in ops                                        # the block id
    assert asm["cubin"]


def test_attention_kernels_compile():
    from kernels import triton_attention as t
    asm = _compile(t._reshape_and_cache_kernel,
                   {"k_ptr": "*fp16", "v_ptr": "*fp16", "kc_ptr": "*fp16", "vc_ptr": "*fp16",
                    "slot_ptr": "*i64", "stride_kt": "i32", "stride_vt": "i32",
                    "HD": "constexpr", "BLOCK": "constexpr"}, {"HD": 192, "BLOCK": 256})
    assert asm["cubin"]
    sig = {"q_ptr": "*fp16", "kc_ptr": "*fp16", "vc_ptr": "*fp16", "bt_ptr": "*i64",
           "cl_ptr": "*i64", "out_ptr": "*fp16", "scale": "fp32",
           **{n: "i32" for n in ("stride_qb", "stride_qh", "stride_btb", "stride_ob",
                                 "stride_oh")},
           **{n: "constexpr" for n in ("HKV", "G", "G_PAD", "D", "D_PAD", "BS")}}
    asm = _compile(t._paged_decode_kernel, sig,
                   {"HKV": 3, "G": 3, "G_PAD": 4, "D": 64, "D_PAD": 64, "BS": 16})
    assert asm["cubin"] and "ex2.approx" in asm["ptx"]                # the softmax's exp
