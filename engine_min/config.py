"""Configuration: the engine's knobs (EngineConfig) and the model's shape (ModelConfig)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype for ``"float32"``/``"float16"``/``"bfloat16"`` (or fp32/fp16/bf16).

    Raises:
        ValueError: an unknown dtype name.
    """
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose float32, float16 or bfloat16")
    return _DTYPES[name]


#: device types an engine runs on; ``"meta"`` builds the engine without values (shapes and
#: placement only: it cannot sample), for tests that check where every tensor lives
DEVICE_TYPES = ("cpu", "cuda", "meta")
#: environment variable that ``auto`` (and no device) defers to when set
DEVICE_ENV = "ENGINE_MIN_DEVICE"


def resolve_device(device: str | torch.device | None) -> str:
    """The device an engine runs on, as a canonical string (``"cpu"``, ``"cuda"``,
    ``"cuda:1"``, ``"meta"``).

    Args:
        device: ``None`` or ``"auto"`` = the environment variable ``ENGINE_MIN_DEVICE`` when
            it is set to something other than ``auto`` (resolved as below; the test suite sets
            it to ``cpu``, whose golden outputs are float32), else ``"cuda"`` when
            ``torch.cuda.is_available()``, else ``"cpu"``; otherwise a ``torch.device`` or a
            string ``torch.device`` accepts.

    Raises:
        ValueError: a device torch cannot parse, a type other than cpu/cuda/meta, CUDA asked
            for where this torch build or machine has none, or a CUDA index past the last GPU.
    """
    if device is None or device == "auto":
        env = os.environ.get(DEVICE_ENV, "").strip()
        if env and env != "auto":
            try:
                return resolve_device(env)
            except ValueError as exc:
                raise ValueError(f"{DEVICE_ENV}={env!r}: {exc}") from None
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"unknown device {device!r}; choose auto, cpu, cuda or cuda:N") from exc
    if dev.type not in DEVICE_TYPES:
        raise ValueError(f"unsupported device {str(dev)!r}; choose auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(dev)!r}: CUDA is not available in this torch build "
                             f"or machine (use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(dev)!r}: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return str(dev)


def default_dtype(device: str) -> str:
    """The compute dtype when none is given: ``"float16"`` on CUDA, ``"float32"`` elsewhere."""
    return "float16" if torch.device(device).type == "cuda" else "float32"


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings (validated at construction).

    Attributes:
        model: path to a GGUF file or a Hugging Face safetensors folder; None = the embedded
            SmolLM2-135M-Instruct GGUF (``weights.default_model_path()``).
        device: where the model's weights, the KV pool, the step's inputs (token ids,
            positions, slot mapping, block tables) and the logits live: ``"auto"``/None
            (default: ``"cuda"`` when CUDA is available, else ``"cpu"``), ``"cpu"``,
            ``"cuda"``, ``"cuda:N"``, or a ``torch.device``; stored resolved, as a string
            (``resolve_device``). Only the sampled token ids come back to the host, once per
            step (all of a step's logits when a request samples non-greedily).
        dtype: weights, activations and KV dtype (``"float32"``, ``"float16"``, ``"bfloat16"``;
            fp32/fp16/bf16); None (default) = by device: float32 on CPU, float16 on CUDA.
        block_size: tokens per KV block.
        kv_cache_bytes: bytes of the preallocated KV pool (rounded down to whole blocks; the
            null block 0 is part of the pool).
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes); at
            least ``block_size``.
        max_num_seqs: most requests running at once.
        max_model_len: longest prompt + output in tokens; None = the model's context length.
        enable_prefix_caching: reuse full KV blocks across requests by chained block hash.
        enable_kv_events: publish the prefix cache's block stored / removed events
            (``engine_min.kv_events``) into ``LLMEngine.kv_event_log`` after each step.
        kv_event_batches: event batches the log retains for late readers (>= 1).
        seed: seed of the sampler's generator for requests without their own seed.
        model_id: the model's name in the KV identity (a KV store's namespace); None = read
            from the model's metadata (``engine_min.identity.model_name``).
        model_revision: the weights revision in the KV identity; None = from the model path
            (a hub cache snapshot's commit) or ``""``.
        weights_fingerprint: put the fingerprint of the loaded weights' content in the KV
            identity (default). False: only ``model_id``/``model_revision`` name the weights,
            and whoever sets it vouches that every engine sharing those names loads the same
            weights (else a store can change answers).

    Raises:
        ValueError: a non-positive size, an unknown dtype, bfloat16 on a GPU without it, or
            a device that is unknown or not on this machine (``resolve_device``).
    """

    model: str | None = None
    dtype: str | None = None
    block_size: int = 16
    kv_cache_bytes: int = 256 * 1024 * 1024
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_kv_events: bool = True
    kv_event_batches: int = 1024
    seed: int = 0
    model_id: str | None = None
    model_revision: str | None = None
    weights_fingerprint: bool = True
    device: str | torch.device | None = None

    def __post_init__(self) -> None:
        device = resolve_device(self.device)
        object.__setattr__(self, "device", device)   # frozen: store the resolved values
        dtype = default_dtype(device) if self.dtype is None else self.dtype
        if not isinstance(dtype, str):
            raise ValueError(f"EngineConfig.dtype must be a dtype name, got {dtype!r}")
        if torch_dtype(dtype) is torch.bfloat16 and device.startswith("cuda") and \
                not torch.cuda.is_bf16_supported():
            raise ValueError(f"dtype {dtype!r}: this GPU has no bfloat16; use float16")
        object.__setattr__(self, "dtype", dtype)
        if self.model_id is not None and not (isinstance(self.model_id, str) and
                                              self.model_id.strip()):
            raise ValueError(f"EngineConfig.model_id must be a non-empty string, got "
                             f"{self.model_id!r}")
        for name in ("block_size", "kv_cache_bytes", "max_num_batched_tokens", "max_num_seqs",
                     "kv_event_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}"
                             f") must be at least the block size ({self.block_size}): a smaller "
                             "step budget prefills a long prompt a few tokens per step "
                             "(minutes for a thousand tokens)")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"EngineConfig.max_model_len must be positive, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def torch_device(self) -> torch.device:
        """``device`` as a ``torch.device``."""
        return torch.device(self.device)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (read from GGUF metadata or config.json).

    Attributes:
        architecture: ``"llama"``, ``"mistral"`` or ``"qwen2"`` (Llama-family names accepted).
        vocab_size, hidden_size, intermediate_size, num_layers: model sizes.
        num_heads / num_kv_heads: query heads and KV heads (GQA when fewer KV heads).
        head_dim: elements per head.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_scaling: None, or a dict with ``rope_type`` in {"linear", "llama3", "yarn"} and
            its parameters (``factor``, ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``).
        max_position: context length in tokens.
        tie_word_embeddings: the LM head reuses the token embedding.
        attention_bias: q/k/v projections have a bias (Qwen2).
        bos_token_id / eos_token_id: special ids (may be None).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def kv_block_bytes(self, block_size: int, itemsize: int) -> int:
        """Bytes of one KV block over all layers, K and V: L * 2 * block_size * H_kv * D * itemsize."""
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * itemsize
