"""Shared fixtures, sizes and helpers of the vLLM end-to-end tests (``test_vllm_connector.py``,
``test_vllm_daemon.py``): the converted model folder, the prompts, the 2-round chat, the
no-connector baseline outputs; the reference KV from transformers, a reference paged gather,
and store wrappers that fail or lose chunks.

A helper module, not a conftest: test files import the fixtures they use by name, so nothing
here reaches the other tests of this folder. Import it only after ``pytest.importorskip("vllm")``.
The baseline (a fresh vLLM process without any connector) runs once per pytest process and is
shared by every file that asks for it (``_baseline_outputs`` is cached); it also answers the two
document questions of ``test_vllm_engine_min_sharing.py`` (``sharing_prompts``), so that file
needs no vLLM process of its own for its no-store reference.
"""
from __future__ import annotations

import functools

import pytest
import torch

from bench.vllm_engine import make_document, run_child
from bench.vllm_model import convert

CHUNK = 256
BLOCK = 128   # vLLM CPU backend's default block size (checked from the engine)
MAX_TOKENS = 12
ROUND1_TOKENS = 190   # round 1's answer of the chat test: it fills chunk 4 and one piece


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(convert())


@pytest.fixture(scope="module")
def prompts(model_dir):
    """P: a ~1250-token document question; Q: P's first 600 tokens + a different tail."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    p = tok.encode(make_document(0, 30) + "\nQuestion: how many tons of grain does Elm3 export?"
                   "\nAnswer:")
    tail = tok.encode("\nSection 99: the town of Zed has a lighthouse.\nQuestion: what does Zed "
                      "have?\nAnswer:")
    q = p[:600] + tail
    assert 1100 < len(p) < 1280, len(p)   # 4 full chunks
    return {"P": p, "Q": q}


@pytest.fixture(scope="module")
def chat(model_dir):
    """A 2-round chat as token lists: U1 (another document's question, 1219..1279 tokens), U2
    (the next question); round 2's prompt = U1 + round 1's answer + U2."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    u1 = tok.encode(make_document(2, 32) + "\nQuestion: how many arches has the bridge of "
                    "Ash4?\nAnswer:")
    u2 = tok.encode("\nQuestion: what is the name of the mayor of Ash5?\nAnswer:")
    assert 1219 <= len(u1) < 1280, len(u1)
    return {"U1": u1, "U2": u2}


def sharing_prompts(model_dir: str) -> list[list[int]]:
    """The two document questions of ``test_vllm_engine_min_sharing.py`` (1153..1267 tokens
    each: 4 full chunks and one 128-token piece of each are stored, and the prompt plus
    MAX_TOKENS generated tokens stays below 5 chunks)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for i, q in ((0, "how many tons of grain does Elm3 export?"),
                 (1, "what is the name of the mayor of Oak7?")):
        ids = tok.encode(make_document(i, 29) + f"\nQuestion: {q}\nAnswer:")
        assert 4 * CHUNK + BLOCK < len(ids) <= 5 * CHUNK - MAX_TOKENS - 1, len(ids)
        out.append(ids)
    return out


@functools.cache
def _baseline_outputs(model_dir: str, p: tuple[int, ...], q: tuple[int, ...],
                      u1: tuple[int, ...], u2: tuple[int, ...]) -> dict:
    shared = sharing_prompts(model_dir)
    res = run_child({"model_dir": model_dir, "connector": "none",
                     "warmup": False, "max_tokens": MAX_TOKENS,
                     "prompts": [list(p), list(q), *shared],
                     "chats": [[list(u1), list(u2)]],
                     "chat_max_tokens": [ROUND1_TOKENS, MAX_TOKENS]})
    outs = [r["output_ids"] for r in res["results"]]
    return {"P": outs[0], "Q": outs[1], "sharing": outs[2:],
            "chat": [r["output_ids"] for r in res["chats"][0]]}


@pytest.fixture(scope="module")
def baseline(model_dir, prompts, chat):
    """Greedy outputs of vLLM without any connector (fresh process, prefix caching off, each
    prompt its own request): P, Q, the chat's two rounds (answers of ROUND1_TOKENS then
    MAX_TOKENS tokens), and ``sharing``: MAX_TOKENS-token answers to ``sharing_prompts``."""
    return _baseline_outputs(model_dir, tuple(prompts["P"]), tuple(prompts["Q"]),
                             tuple(chat["U1"]), tuple(chat["U2"]))


def hf_kv(model_dir: str, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Reference K, V per layer from transformers: ``[num_kv_heads, T, head_dim]`` each."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        pkv = m(torch.tensor([tokens]), use_cache=True).past_key_values
    if hasattr(pkv, "layers"):
        return [(layer.keys[0], layer.values[0]) for layer in pkv.layers]
    return [(k[0], v[0]) for k, v in pkv]


def paged_gather_ref(cache: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The elements at flat offsets ``offs`` of a paged cache, by plain indexing (the
    reference the paged layout's own gather is checked against)."""
    return cache.reshape(-1)[offs]


class Failing:
    """Store wrapper whose named methods raise (as a dead daemon or a deadline would)."""

    def __init__(self, inner, fail: set[str]):
        self.inner, self.fail = inner, fail

    def __getattr__(self, name):
        if name in self.fail:
            def boom(*a, **k):
                raise TimeoutError(f"{name}: injected deadline")
            return boom
        return getattr(self.inner, name)


class Missing:
    """Store wrapper whose ``get_chunks`` answers None for the chunks at ``index`` of each
    call whose namespace is ``ns`` (evicted between lookup and load)."""

    def __init__(self, inner, ns, index: int):
        self.inner, self.ns, self.index = inner, ns, index

    def get_chunks(self, ns, keys, *a, **k):
        got = self.inner.get_chunks(ns, keys, *a, **k)
        if ns == self.ns and len(got) > self.index:
            got[self.index] = None
        return got

    def __getattr__(self, name):
        return getattr(self.inner, name)
