"""The chunk-key namespace of a vLLM engine: everything in vLLM's config that changes the KV of
the same token ids (``kvstore.keys.Namespace``). Importable without vLLM (reads the config
objects' attributes only), so it is tested without it.

From ``vllm_config`` (``kv_connector_extra_config`` keys override where named):

======================  =================================================================
namespace field         source
======================  =================================================================
model_id                ``model_id``; else ``model_config.served_model_name`` (the first
                        when a list); else ``model_config.model``
revision                ``revision``; else ``model_config.revision``; else ``""``
weights_fingerprint     ``weights_fingerprint``: ``"auto"`` (default) = the content
                        fingerprint of the local model file or folder
                        (``engine_min.identity.weights_fingerprint``: xxh3_128 over every
                        tensor's raw bytes); ``"off"`` = none (the names vouch for the
                        weights); any other string is used as given. A hub id that is not
                        a local path gets none: pin ``revision`` then.
compute_dtype           ``model_config.dtype`` (``"float32"``...)
rope                    ``hf_text_config.rope_parameters`` (transformers 5), else
                        ``rope_theta`` and ``rope_scaling``, in
                        ``kvstore.keys.rope_identity``'s form (engine_min's too)
quantization            ``model_config.quantization`` (``"awq"``, ``"fp8"``...), else ``""``
kv_quantization         ``cache_config.cache_dtype`` unless ``"auto"``, with
                        ``calculate_kv_scales`` and ``kv_cache_dtype_skip_layers`` when set
adapter                 per request: its ``lora_request`` (the content fingerprint of a
                        local adapter folder, else name and path); ``""`` without LoRA
======================  =================================================================

KV dtype and chunk size are in the namespace's ``KVLayout``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from functools import lru_cache
from typing import Any

from kvstore.daemon.tenants import bind_salt
from kvstore.keys import Namespace, canonical_json, rope_identity
from kvstore.layout import KVLayout

log = logging.getLogger("kvstore.connectors.vllm")


@lru_cache(maxsize=16)
def _fingerprint(path: str, size: int, mtime_ns: int) -> str:
    """Cached per (path, size, mtime): vLLM builds a scheduler-side and a worker-side
    connector in one process."""
    from engine_min.identity import weights_fingerprint
    return weights_fingerprint(path)


def local_fingerprint(path: str) -> str:
    """Content fingerprint of a local ``.gguf`` file or safetensors folder, or ``""`` when
    ``path`` is neither (a hub id, a folder without ``*.safetensors``)."""
    is_gguf = os.path.isfile(path) and path.endswith(".gguf")
    is_st = os.path.isdir(path) and any(n.endswith(".safetensors") for n in os.listdir(path))
    if not (is_gguf or is_st):
        return ""
    st = os.stat(path)
    return _fingerprint(os.path.abspath(path), st.st_size, st.st_mtime_ns)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else ""


def _rope(hf_config: Any) -> str:
    """RoPE as ``kvstore.keys.rope_identity`` writes it (the form engine_min's connector
    writes too, so both engines name the same model's RoPE alike)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta, scaling = params.get("rope_theta"), params
    else:
        theta = getattr(hf_config, "rope_theta", None)
        scaling = getattr(hf_config, "rope_scaling", None)
    if theta is None or (scaling is not None and not isinstance(scaling, dict)):
        return json.dumps({"rope_parameters": params, "rope_theta": theta}, sort_keys=True,
                          separators=(",", ":"), default=str)   # not a form we can normalize
    return canonical_json(rope_identity(theta, scaling))


def _kv_quantization(cache_config: Any) -> str:
    cache_dtype = str(getattr(cache_config, "cache_dtype", "auto") or "auto")
    if cache_dtype == "auto":
        return ""
    q = {"cache_dtype": cache_dtype,
         "calculate_kv_scales": bool(getattr(cache_config, "calculate_kv_scales", False))}
    skip = list(getattr(cache_config, "kv_cache_dtype_skip_layers", None) or [])
    if skip:
        q["skip_layers"] = skip
    return json.dumps(q, sort_keys=True, separators=(",", ":"))


def _weights(model: str, setting: Any) -> str:
    setting = "auto" if setting is None else str(setting)
    if setting == "off":
        return ""
    if setting != "auto":
        return setting
    fp = local_fingerprint(model)
    if not fp:
        log.warning("model %r is not a local file or folder: its weights are not "
                    "fingerprinted; the namespace names them by model id and revision only", model)
    return fp


def vllm_namespace(vllm_config: Any, layout: KVLayout, extra: dict) -> Namespace:
    """The base namespace (no tenant salt, no adapter) of the engine ``vllm_config`` describes
    (module docstring), over ``layout``.

    Raises:
        ValueError: an unknown ``hash_algo``.
    """
    mc = vllm_config.model_config
    served = getattr(mc, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    return Namespace(
        model_id=str(extra.get("model_id") or served or mc.model), layout=layout,
        revision=str(extra.get("revision") or getattr(mc, "revision", None) or ""),
        hash_algo=str(extra.get("hash_algo", "sha256")),
        weights_fingerprint=_weights(str(mc.model), extra.get("weights_fingerprint")),
        compute_dtype=_dtype_name(getattr(mc, "dtype", None)),
        rope=_rope(hf) if hf is not None else "",
        quantization=str(getattr(mc, "quantization", None) or ""),
        kv_quantization=_kv_quantization(getattr(vllm_config, "cache_config", None)))


def adapter_identity(lora_request: Any) -> str:
    """A request's LoRA adapter as canonical JSON, or ``""`` without one: the content
    fingerprint of a local adapter folder, else its name and path (two processes then share
    chunks only under the same name and path)."""
    if lora_request is None:
        return ""
    path = str(getattr(lora_request, "lora_path", "") or "")
    fp = local_fingerprint(path) if path else ""
    ident = {"weights": fp} if fp else {"name": str(getattr(lora_request, "lora_name", "")),
                                        "path": path}
    return json.dumps(ident, sort_keys=True, separators=(",", ":"))


def request_namespace(base: Namespace, cache_salt: str, lora_request: Any) -> Namespace:
    """``base`` with a request's tenant salt and adapter."""
    return dataclasses.replace(base, cache_salt=cache_salt,
                               adapter=adapter_identity(lora_request))


class RequestNamespaces:
    """The namespaces of one vLLM engine's requests: its base namespace bound to the daemon
    tenant's salt, each request's (its ``cache_salt`` and LoRA adapter), and the namespace of
    tail pieces (the same but the chunk size). Cached: one object per distinct value.

    Args:
        base: the engine's namespace (``vllm_namespace``), no salt, no adapter.
        tenant_salt: the daemon tenant's salt every namespace carries, or None.
        tail_chunk_size: tokens per tail piece; 0 = tail pieces off.
    """

    def __init__(self, base: Namespace, tenant_salt: str | None, tail_chunk_size: int) -> None:
        self.tenant_salt = tenant_salt
        self.tail_chunk_size = tail_chunk_size
        #: the engine's namespace for requests without a salt or an adapter
        self.base = dataclasses.replace(base, cache_salt=bind_salt(tenant_salt,
                                                                   base.cache_salt))
        self._by_request: dict[tuple[str, str], Namespace] = {}
        if tenant_salt is None:
            self._by_request[("", "")] = self.base
        self._tails: dict[bytes, Namespace] = {}

    def of(self, request: Any) -> Namespace:
        """``request``'s namespace: the base one with its ``cache_salt`` (bound to the tenant
        salt) and LoRA adapter (``lora_request``)."""
        salt = bind_salt(self.tenant_salt, getattr(request, "cache_salt", None) or "")
        lora = getattr(request, "lora_request", None)
        key = (salt, adapter_identity(lora)) if lora is not None else (salt, "")
        ns = self._by_request.get(key)
        if ns is None:
            ns = self._by_request[key] = request_namespace(self.base, salt, lora)
        return ns

    def tail(self, ns: Namespace) -> Namespace | None:
        """The namespace of tail pieces for ``ns`` (same model, salt and layout but the tail
        chunk size), or None when tail pieces are off."""
        if not self.tail_chunk_size:
            return None
        t = self._tails.get(ns.ns_id)
        if t is None:
            lay = dataclasses.replace(ns.layout, chunk_size=self.tail_chunk_size)
            t = self._tails[ns.ns_id] = dataclasses.replace(ns, layout=lay)
        return t
