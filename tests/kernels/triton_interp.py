"""Loading a Triton kernel module in Triton's interpreter, for tests on CPU tensors."""
import importlib.util
import os
import pathlib

from kernels import reference


def load_interpreted(name: str):
    """A private copy of ``kernels/<name>.py`` whose kernels run in Triton's interpreter
    (``TRITON_INTERPRET=1`` while it is imported: ``triton.jit`` reads it then). The real
    module, compiled on CUDA, is left alone."""
    path = pathlib.Path(reference.__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"kernels._{name}_interpreted", path)
    mod = importlib.util.module_from_spec(spec)
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    return mod


def attention_vs_reference() -> dict:
    """``kernels.triton_attention`` against the reference on CPU tensors; run in a process
    started with ``TRITON_INTERPRET=1`` (its kernels call Triton's jit'd library functions,
    ``tl.sum``, ``tl.cdiv``..., which run in the interpreter only when Triton itself was
    imported so). Returns ``{"decode": {case: max abs error}, "reshape_and_cache": equal}``."""
    import torch

    from kernels import triton_attention as ta

    assert os.environ.get("TRITON_INTERPRET") == "1", "start the process with TRITON_INTERPRET=1"
    g = torch.Generator().manual_seed(0)
    errors = {}
    for hq, hkv, d, bs in [(9, 3, 64, 16), (8, 8, 32, 16), (4, 1, 80, 8)]:
        nb, b = 32, 4
        kv = torch.randn(2, nb, bs, hkv, d, generator=g)  # [2, num_blocks, block_size, heads, dim]
        lens = torch.tensor([1, bs, bs + 1, 3 * bs - 2])
        tables = torch.zeros(b, 4, dtype=torch.long)
        perm = torch.randperm(nb - 1, generator=g)[:b * 4].view(b, 4) + 1
        for i, n in enumerate(lens.tolist()):
            tables[i, :-(-n // bs)] = perm[i, :-(-n // bs)]  # scattered blocks, null-padded
        q = torch.randn(b, hq, d, generator=g)
        want = reference.paged_attention_decode(q, kv, tables, lens, d ** -0.5)
        got = ta.paged_attention_decode(q, kv, tables, lens, d ** -0.5)
        errors[f"{hq}-{hkv}-{d}-{bs}"] = (got - want).abs().max().item()
    nb, bs, h, d, t = 8, 16, 3, 64, 21
    qkv = torch.randn(t, (9 + 2 * h) * d, generator=g)    # strided views, as in the model
    key, value = qkv[:, 9 * d:(9 + h) * d].view(t, h, d), qkv[:, (9 + h) * d:].view(t, h, d)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    a = torch.zeros(2, nb, bs, h, d)
    b2 = torch.zeros_like(a)
    reference.reshape_and_cache(key, value, a, slots)
    ta.reshape_and_cache(key, value, b2, slots)
    return {"decode": errors, "reshape_and_cache": bool(torch.equal(a, b2)),
            "written": int((a[0] != 0).view(nb * bs, h * d).any(-1).sum())}  # K slots written
