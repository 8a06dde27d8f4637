"""engine_min on a device: ``EngineConfig.device`` / ``dtype`` resolution and refusals, the
``--device`` flag of the entry points (refused before any model load), explicit CPU giving the
outputs the engine gave before devices existed, and every tensor of an engine placed on its
device (an engine built on ``meta``: a stray host tensor in the forward would show)."""
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import engine_min.engine as engine_mod
from engine_min.config import EngineConfig, resolve_device
from engine_min.engine import LLMEngine
from engine_min.sampler import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
# the engine's outputs before it had a device (commit e349806, fp32 on the CPU): 16 greedy
# tokens per prompt, then three rows of 8 (seeded temperature 0.8, greedy, seeded top-p 0.9)
GREEDY_16 = [[7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33],
             [472, 585, 304, 1758, 216, 32, 42, 448, 1003, 216, 33, 472, 1003, 304, 1672, 3987],
             [216, 33, 32, 32, 4742, 51, 28, 527, 314, 253, 3468, 20590, 30, 198, 198, 504]]
MIXED_8 = [[7042, 30, 198, 198, 504, 2240, 21186, 354],
           [472, 585, 304, 1758, 216, 32, 42, 448],
           [216, 34, 39, 37, 4742, 51, 365, 36]]
MIXED_PARAMS = [SamplingParams(max_tokens=8, temperature=0.8, seed=7, ignore_eos=True),
                SamplingParams(max_tokens=8, ignore_eos=True),
                SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)]


# ---- configuration ----------------------------------------------------------------------------
def test_cpu_as_string_or_torch_device_and_its_default_dtype():
    for dev in ("cpu", torch.device("cpu"), "auto", None):
        c = EngineConfig(device=dev)
        assert (c.device, c.dtype, c.torch_device) == ("cpu", "float32", torch.device("cpu"))
    assert EngineConfig(device="cpu", dtype="bf16").torch_dtype is torch.bfloat16
    assert EngineConfig(device="cpu", dtype="float16").dtype == "float16"


@pytest.mark.parametrize("device,msg", [
    ("cuda", "device 'cuda': CUDA is not available in this torch build or machine"),
    ("cuda:1", "device 'cuda:1': CUDA is not available"),
    (torch.device("cuda", 0), "device 'cuda:0': CUDA is not available"),
    ("mps", "unsupported device 'mps'; choose auto, cpu, cuda or cuda:N"),
    ("gpu0", "unknown device 'gpu0'; choose auto, cpu, cuda or cuda:N"),
    (0, "device must be a str or torch.device, got int"),
])
def test_a_device_this_machine_lacks_is_refused(device, msg):
    if torch.cuda.is_available() and "CUDA is not available" in msg:
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        EngineConfig(device=device)


@pytest.mark.parametrize("dtype", ["int8", "float64", 16])
def test_a_bad_dtype_is_refused(dtype):
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(device="cpu", dtype=dtype)


def test_on_a_cuda_machine_auto_is_cuda_in_float16(monkeypatch):
    """The CUDA branch of the resolution, run here with CUDA reported present: auto picks
    cuda, the dtype defaults to float16, bfloat16 needs a GPU that has it, and an index past
    the last GPU is refused."""
    monkeypatch.delenv("ENGINE_MIN_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    c = EngineConfig()
    assert (c.device, c.dtype, c.torch_dtype) == ("cuda", "float16", torch.float16)
    assert EngineConfig(device="cuda:1", dtype="float32").device == "cuda:1"
    assert resolve_device(torch.device("cuda", 1)) == "cuda:1"
    with pytest.raises(ValueError, match="device 'cuda:2': this machine has 2 CUDA device"):
        EngineConfig(device="cuda:2")
    with pytest.raises(ValueError, match="this GPU has no bfloat16; use float16"):
        EngineConfig(dtype="bfloat16")
    assert EngineConfig(device="cpu", dtype="bfloat16").dtype == "bfloat16"  # CPU: allowed


# ---- entry points: refused before the model loads ----------------------------------------------
@pytest.fixture
def no_model_load(monkeypatch):
    monkeypatch.setattr(engine_mod, "load_model",
                        lambda *a, **k: pytest.fail("the model was loaded"))


@pytest.mark.parametrize("flags,msg", [
    (["--device", "cuda"], "error: device 'cuda': CUDA is not available in this torch build "
                           "or machine (use --device cpu)"),
    (["--device", "tpu"], "error: unknown device 'tpu'; choose auto, cpu, cuda or cuda:N"),
    (["--device", "cpu", "--dtype", "int8"],
     "error: unsupported dtype 'int8'; choose float32, float16 or bfloat16"),
])
def test_generate_refuses_a_bad_device_or_dtype_with_one_error_line(no_model_load, capsys,
                                                                    flags, msg):
    if torch.cuda.is_available() and "cuda" in flags:
        pytest.skip("this machine has CUDA")
    from engine_min.cli import main
    assert main(["generate", "--prompt", "hi", *flags]) == 2
    assert capsys.readouterr().err.splitlines() == [msg]


def test_serve_refuses_cuda_here_before_store_or_model(no_model_load, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from engine_min.cli import main
    from engine_min.serve import cli as serve_cli
    monkeypatch.setattr(serve_cli, "build_connector", lambda *a: pytest.fail("store built"))
    assert main(["serve", "--port", "0", "--device", "cuda:0", "--kvstore-cpu-bytes",
                 "64MiB"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: device 'cuda:0': CUDA is not available in this torch build or machine "
        "(use --device cpu)"]


def test_serve_flags_carry_device_and_dtype():
    import argparse
    from engine_min.serve.cli import add_serve_args, engine_config
    parse = add_serve_args(argparse.ArgumentParser()).parse_args
    assert (engine_config(parse([])).device, engine_config(parse([])).dtype) == \
        (resolve_device("auto"), "float16" if torch.cuda.is_available() else "float32")
    c = engine_config(parse(["--device", "cpu", "--dtype", "bfloat16"]))
    assert (c.device, c.dtype) == ("cpu", "bfloat16")


# ---- explicit CPU = the engine before devices ---------------------------------------------------
def test_explicit_cpu_gives_the_outputs_of_the_engine_before_devices():
    """``device="cpu"`` (and a ``torch.device``) computes exactly the token ids the engine
    computed before it had a device: greedy, and seeded temperature/top-p rows sampled in one
    batch with a greedy row (the sampler's host path)."""
    eng = LLMEngine(EngineConfig(device=torch.device("cpu"), kv_cache_bytes=32 * 2**20))
    assert eng.kv_cache.device == torch.device("cpu") and eng.config.dtype == "float32"
    out = eng.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.output_token_ids for o in out] == GREEDY_16
    out = eng.generate(PROMPTS, MIXED_PARAMS)
    assert [o.output_token_ids for o in out] == MIXED_8


# ---- every tensor on the engine's device -------------------------------------------------------
class _TensorDevices(TorchFunctionMode):
    """Records the device of every tensor (of one or more dims) a torch function takes or
    returns while active."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, set[str]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                self.seen.setdefault(t.device.type, set()).add(getattr(func, "__name__", "?"))
        return out


def test_every_engine_tensor_is_created_on_the_configured_device():
    """An engine built on ``meta`` (shapes without values): weights, RoPE frequencies and KV
    pool are there, the step's inputs (token ids, positions, slot mapping, block tables,
    context lens, logits indices) are moved there, and a prefill step then a decode step
    through the model and the LM head touch no tensor anywhere else. A tensor created on a
    hard-coded device would be a CPU tensor in this record."""
    eng = LLMEngine(EngineConfig(device="meta", kv_cache_bytes=8 * 2**20))
    meta = torch.device("meta")
    assert eng.kv_cache.device == meta
    assert {p.device for p in eng.model.parameters()} == {meta}
    assert eng.model.rotary.inv_freq.device == meta
    rids = [eng.add_request(p, SamplingParams(max_tokens=4)) for p in PROMPTS[:2]]
    for step in ("prefill", "decode"):
        sched = eng.scheduler.schedule()
        assert {it.num_new_tokens > 1 for it in sched.scheduled} == {step == "prefill"}
        ordered, ids, pos, att, sample_idx = eng.runner.prepare(sched.scheduled)
        inputs = [ids, pos, sample_idx, att.slot_mapping] + [s.block_table for s in att.prefills]
        if att.num_decode:
            inputs += [att.decode_block_tables, att.decode_context_lens]
        assert {t.device for t in inputs} == {meta}, step
        with _TensorDevices() as rec:
            hidden = eng.model(ids, pos, eng.kv_cache, att)
            logits = eng.model.compute_logits(hidden[sample_idx])
        assert set(rec.seen) == {"meta"}, (step, rec.seen)
        assert logits.shape == (2, eng.model_config.vocab_size) and logits.device == meta
        for it in ordered:     # as the engine's step does, with a stand-in sampled token
            eng._advance(it)
            it.seq.token_ids.append(198)
    assert len(rids) == 2


def test_auto_defers_to_engine_min_device(monkeypatch):
    """``ENGINE_MIN_DEVICE`` decides what auto (and no device) means, even where CUDA is
    reported present; an explicit device wins over it; a bad value names the variable."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("ENGINE_MIN_DEVICE", "cpu")
    assert (EngineConfig().device, EngineConfig(device="auto").dtype) == ("cpu", "float32")
    assert EngineConfig(device="cuda").device == "cuda"
    monkeypatch.setenv("ENGINE_MIN_DEVICE", "auto")
    assert resolve_device(None) == "cuda"
    monkeypatch.setenv("ENGINE_MIN_DEVICE", "tpu")
    with pytest.raises(ValueError, match="ENGINE_MIN_DEVICE='tpu': unknown device 'tpu'"):
        EngineConfig()
