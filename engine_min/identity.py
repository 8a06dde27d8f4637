"""What the engine loaded, as names: the model's id and revision from its own metadata, a
fingerprint of the weights' content, and the KV identity a KV store namespaces chunks by.

Model id (``model_name``), first that applies:

* GGUF: ``general.source.huggingface.repository``; else a Hugging Face URL in
  ``general.source.url`` / ``general.source.repo_url`` / ``general.url`` / ``general.repo_url``
  (``https://huggingface.co/ORG/NAME`` -> ``ORG/NAME``); else ``general.organization`` + ``/`` +
  the file's stem without its quantization tag (llama.cpp's file naming ``<repo>.<quant>.gguf``:
  the shipped ``SmolLM2-135M-Instruct.Q4_1.gguf`` with organization ``HuggingFaceTB`` gives
  ``HuggingFaceTB/SmolLM2-135M-Instruct``); else that stem alone.
* Hugging Face folder: a hub cache path ``.../models--ORG--NAME/snapshots/SHA`` gives
  ``ORG/NAME`` at revision ``SHA``; else config.json's ``_name_or_path`` when it reads
  ``ORG/NAME``; else the folder's name.

Weights fingerprint (``weights_fingerprint``): ``"xxh3_128:" + 32 hex digits`` of every tensor in
the file(s), in name order: its name, stored type, shape and raw bytes as stored (quantized
blocks as they are; safetensors data as it is). Raw bytes rather than dequantized values: the
dequantized weights are a pure function of the raw bytes and type, so equal raw bytes mean equal
weights, and hashing the stored bytes reads each byte once without dequantizing (the file is
memory-mapped; 4x fewer bytes than fp32 for Q4 files). Two encodings of equal values get
different fingerprints, which costs sharing between them, never a wrong answer.
"""
from __future__ import annotations

import json
import logging
import os
import time
import re
import struct
from pathlib import Path

import numpy as np
import xxhash

log = logging.getLogger("engine_min.identity")

FINGERPRINT_ALGO = "xxh3_128"
_QUANT_TAG = re.compile(r"[.\-_](?:i?q\d+(?:_[a-z0-9]+)*|f16|f32|bf16|fp16|fp32)$", re.I)
_HF_URL = re.compile(r"^https?://(?:www\.)?huggingface\.co/([\w.\-]+/[\w.\-]+?)/?$")
_REPO_ID = re.compile(r"^[\w.\-]+/[\w.\-]+$")
_HF_CACHE = re.compile(r"models--([\w.\-]+?)--([\w.\-]+)$")


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def strip_quant_tag(stem: str) -> str:
    """``"SmolLM2-135M-Instruct.Q4_1"`` -> ``"SmolLM2-135M-Instruct"`` (also ``-Q4_K_M``,
    ``.IQ4_XS``, ``-f16``, ``.bf16``...); a stem without such a tag is returned as it is."""
    return _QUANT_TAG.sub("", stem)


def _gguf_name(path: str, reader) -> tuple[str, str]:
    repo = _field(reader, "general.source.huggingface.repository")
    if isinstance(repo, str) and _REPO_ID.match(repo):
        return repo, ""
    for key in ("general.source.url", "general.source.repo_url", "general.url",
                "general.repo_url"):
        m = _HF_URL.match(str(_field(reader, key) or ""))
        if m:
            return m.group(1), ""
    stem = strip_quant_tag(Path(path).stem)
    org = _field(reader, "general.organization")
    if isinstance(org, str) and re.fullmatch(r"[\w.\-]+", org):
        return f"{org}/{stem}", ""
    return stem, ""


def _folder_name(folder: Path) -> tuple[str, str]:
    parts = folder.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots":
        m = _HF_CACHE.search(parts[-3])
        if m:
            return f"{m.group(1)}/{m.group(2)}", parts[-1]
    try:
        name = json.loads((folder / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        name = None
    if isinstance(name, str) and _REPO_ID.match(name) and not os.path.exists(name):
        return name, ""
    return folder.resolve().name, ""


def model_name(path: str, reader=None) -> tuple[str, str]:
    """``(model_id, revision)`` of a GGUF file or a Hugging Face folder (module docstring);
    revision is ``""`` unless the path names one (a hub cache snapshot).

    Args:
        path: the ``.gguf`` file or the folder.
        reader: the file's ``weights.open_gguf(path)`` when the caller has one.
    """
    if os.path.isdir(path):
        return _folder_name(Path(path))
    if reader is None:
        from engine_min.weights import open_gguf
        reader = open_gguf(path)
    return _gguf_name(path, reader)


def _hash_entry(h, name: str, kind: str, shape, data) -> None:
    h.update(f"{name}|{kind}|{','.join(str(int(s)) for s in shape)}|".encode())
    h.update(data)


def _gguf_fingerprint(reader) -> str:
    h = xxhash.xxh3_128()
    for t in sorted(reader.tensors, key=lambda t: t.name):
        data = t.data if t.data.flags.c_contiguous else np.ascontiguousarray(t.data)
        _hash_entry(h, t.name, t.tensor_type.name, t.shape.tolist(), memoryview(data).cast("B"))
    return f"{FINGERPRINT_ALGO}:{h.hexdigest()}"


def _safetensors_entries(file: Path) -> list[tuple[str, str, list, int, int]]:
    """``(name, dtype, shape, start, end)`` of each tensor; offsets are file offsets."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    return [(k, v["dtype"], v["shape"], base + v["data_offsets"][0], base + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"]


def _folder_fingerprint(folder: Path) -> str:
    entries = []
    for file in sorted(folder.glob("*.safetensors")):
        entries += [(e, file) for e in _safetensors_entries(file)]
    h = xxhash.xxh3_128()
    maps: dict[Path, np.memmap] = {}
    for (name, dtype, shape, lo, hi), file in sorted(entries, key=lambda e: e[0][0]):
        if file not in maps:
            maps[file] = np.memmap(file, dtype=np.uint8, mode="r")
        _hash_entry(h, name, dtype, shape, memoryview(maps[file][lo:hi]))
    return f"{FINGERPRINT_ALGO}:{h.hexdigest()}"


def weights_fingerprint(path: str, reader=None) -> str:
    """``"xxh3_128:<32 hex>"`` of the weights' content (module docstring): the same for two
    loads of the same bytes, whatever the file is called; different when any tensor byte,
    name, type or shape differs. Takes ~0.05 s for the shipped 98 MB GGUF (bytes already in
    the page cache).

    Args:
        path: a ``.gguf`` file or a folder of ``*.safetensors``.
        reader: the file's ``weights.open_gguf(path)`` when the caller has one.

    Raises:
        ModelLoadError: the file cannot be parsed.
    """
    if os.path.isdir(path):
        return _folder_fingerprint(Path(path))
    if reader is None:
        from engine_min.weights import open_gguf
        reader = open_gguf(path)
    return _gguf_fingerprint(reader)


def kv_identity(config, model_config, model_id: str, revision: str,
                fingerprint: str) -> dict[str, str]:
    """What changes the KV of the same token ids in this engine, as strings (the fields of a
    KV store namespace; see ``kvstore.keys.Namespace``): ``model_id``, ``revision``,
    ``weights_fingerprint``, ``compute_dtype``, ``rope`` (canonical JSON of RoPE theta and
    scaling), ``quantization``, ``kv_quantization`` and ``adapter`` (engine_min has no LoRA,
    no KV quantization and dequantizes weights at load: those three are ``""``).

    ``config.model_id`` / ``config.model_revision`` replace the derived ``model_id`` /
    ``revision`` when set; ``config.weights_fingerprint=False`` leaves the fingerprint out
    (the names then vouch for the weights).

    Args:
        config: the ``EngineConfig``; model_config: the loaded ``ModelConfig``.
        model_id, revision: from ``model_name``; fingerprint: from ``weights_fingerprint``.
    """
    rope = {"theta": model_config.rope_theta, "scaling": model_config.rope_scaling}
    return {"model_id": config.model_id or model_id,
            "revision": config.model_revision if config.model_revision is not None else revision,
            "weights_fingerprint": fingerprint if config.weights_fingerprint else "",
            "compute_dtype": config.dtype,
            "rope": json.dumps(rope, sort_keys=True, separators=(",", ":")),
            "quantization": "", "kv_quantization": "", "adapter": ""}


def load_identity(path: str, reader, config, model_config) -> dict[str, str]:
    """``kv_identity`` of the model at ``path`` (a GGUF file with its parsed ``reader``, or a
    folder with ``reader=None``): reads its name and fingerprints its weights once, logging
    the fingerprint and the seconds it took.

    Raises:
        ModelLoadError: the file cannot be parsed.
    """
    name, revision = model_name(path, reader)
    fingerprint = ""
    if config.weights_fingerprint:
        t0 = time.perf_counter()
        fingerprint = weights_fingerprint(path, reader)
        log.info("weights fingerprint %s (%.3f s)", fingerprint, time.perf_counter() - t0)
    return kv_identity(config, model_config, name, revision, fingerprint)
