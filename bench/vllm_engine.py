"""One vLLM engine process driven by a JSON spec, the synthetic documents its prompts are made
of, and a ``kvstore serve`` subprocess: the parts of ``bench.vllm_compare`` that the vLLM
integration tests use too.

``run_child(spec)`` starts ``python -m bench.vllm_engine SPEC_JSON`` (vLLM keeps global state, so
every configuration gets a fresh process); the child runs ``child_main(spec)`` and prints one
line ``RESULT <json>``. Spec keys: ``model_dir``, ``connector`` (``none``, ``example``,
``ours-cpu``, ``ours-daemon``), ``url`` (the daemon), ``chunk_size``, ``cpu_bytes``, ``extra``
(more ``kv_connector_extra_config`` keys), ``kv_role`` (ours; default ``kv_both``),
``prefix_caching``, ``max_model_len``, ``kv_cache_bytes``, ``warmup``, ``max_tokens``,
``prompts`` (token lists), ``chats`` and ``chat_max_tokens``, ``ttft_separate``,
``example_path``.

Needs vLLM (tools/make_vllm_env.sh) in the child's interpreter.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from kvstore.defaults import DEFAULT_CHUNK_SIZE

ROOT = Path(__file__).resolve().parent.parent
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: vLLM CPU backend's KV block size (tokens): its tail pieces; engine_min is given it to share
VLLM_CPU_BLOCK = 128


def make_document(i: int, n_paragraphs: int) -> str:
    """A synthetic document with facts the questions ask about (deterministic)."""
    towns = ["Elm", "Oak", "Ash", "Fir", "Yew", "Bay", "Pine"]
    t = towns[i % len(towns)]
    paras = [f"Section {j}: the river town of {t}{j} exports {(j * 7 + i) % 97 + 3} tons of "
             f"grain each year; its mayor is named Ann{t}{j} and its bridge has {j % 9 + 2} arches."
             for j in range(n_paragraphs)]
    return f"Report {i} on the towns of the {t} valley.\n" + "\n".join(paras)


def _engine(spec: dict):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kind = spec["connector"]
    ktc = None
    if kind == "example":
        ktc = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                               kv_connector_extra_config={"shared_storage_path": spec["example_path"]})
    elif kind in ("ours-cpu", "ours-daemon"):
        extra = {"model_id": MODEL_ID, "chunk_size": spec.get("chunk_size", DEFAULT_CHUNK_SIZE)}
        if kind == "ours-daemon":   # the daemon alone (in-process keys would be ignored)
            extra["kvstore_url"] = spec["url"]
        else:
            extra["cpu_bytes"] = spec.get("cpu_bytes", "512MiB")
        extra.update(spec.get("extra", {}))
        ktc = KVTransferConfig(kv_connector="KVStoreConnector",
                               kv_connector_module_path="connectors.vllm",
                               kv_role=spec.get("kv_role", "kv_both"),
                               kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    return LLM(model=spec["model_dir"], dtype="float32", distributed_executor_backend="uni",
               max_model_len=spec.get("max_model_len", 4096), enforce_eager=True, seed=0,
               kv_cache_memory_bytes=spec.get("kv_cache_bytes", 256 << 20),
               enable_prefix_caching=bool(spec.get("prefix_caching", False)),
               kv_transfer_config=ktc, disable_log_stats=False)


def _connector_stats(llm) -> dict:
    out = {}
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        if has_kv_transfer_group():
            w = get_kv_transfer_group()
            if hasattr(w, "flush"):
                w.flush()
            if hasattr(w, "stats"):
                out["worker"] = w.stats()
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
        if sched is not None and hasattr(sched, "stats"):
            out["scheduler"] = sched.stats()
    except Exception as e:  # stats are best effort
        out["error"] = repr(e)
    return out


def _request(llm, tokens: list[int], max_tokens: int, spec: dict,
             ignore_eos: bool = False) -> dict:
    """One greedy request: its TTFT (s; vLLM's request metrics, or a separate 1-token generate
    with ``spec["ttft_separate"]``), wall time, answer ids and text, connector stats after it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    r: dict = {"num_tokens": len(tokens)}
    if spec.get("ttft_separate", False):
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=tokens)],
                     SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        r["ttft_s"] = time.perf_counter() - t
    t = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)],
                       SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                      ignore_eos=ignore_eos), use_tqdm=False)[0]
    r["gen_s"] = time.perf_counter() - t
    m = getattr(out, "metrics", None)
    if "ttft_s" not in r and m is not None and getattr(m, "first_token_ts", 0):
        # engine-core monotonic timestamps: queued -> first token
        r["ttft_s"] = m.first_token_ts - (m.queued_ts or m.scheduled_ts)
    r["output_ids"] = list(out.outputs[0].token_ids)
    r["text"] = out.outputs[0].text
    # prompt tokens not computed: vLLM's own prefix-cache hit plus what a connector loaded
    r["num_cached_tokens"] = getattr(out, "num_cached_tokens", None)
    st = _connector_stats(llm)
    if st:
        r["connector"] = st
    return r


def child_main(spec: dict) -> dict:
    """Run ``spec["prompts"]`` (token lists) in one fresh engine, then each chat of
    ``spec["chats"]`` (a chat: its user turns as token lists; round ``k``'s prompt = round
    ``k-1``'s prompt + its answer + turn ``k``; answers of ``spec["chat_max_tokens"][k]``
    tokens, exactly that many: EOS ignored). Per request (``results``; ``chats``, one list of
    rounds per chat): the TTFT (s), the greedy answer (``max_tokens`` tokens for prompts),
    connector stats after it."""
    t0 = time.perf_counter()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    llm = _engine(spec)
    start_s = time.perf_counter() - t0
    if spec.get("warmup", True):  # first forward passes are slow (allocations, kernels)
        llm.generate([TokensPrompt(prompt_token_ids=list(range(1000, 1300)))],
                     SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    max_tokens = int(spec.get("max_tokens", 16))
    results = [_request(llm, list(tokens), max_tokens, spec) for tokens in spec["prompts"]]
    chats = []
    for turns in spec.get("chats", []):
        rounds: list[dict] = []
        prompt: list[int] = []
        for k, turn in enumerate(turns):
            prompt = prompt + (rounds[-1]["output_ids"] if rounds else []) + list(turn)
            n = spec.get("chat_max_tokens", [max_tokens] * (k + 1))[k]
            rounds.append({**_request(llm, prompt, int(n), spec, ignore_eos=True),
                           "prompt_ids": prompt})
        chats.append(rounds)
    return {"start_s": start_s, "results": results, "chats": chats,
            "connector": _connector_stats(llm)}


def run_child(spec: dict, python: str | None = None, timeout_s: float = 600) -> dict:
    """Run ``child_main(spec)`` in a fresh process; returns its result dict.

    Raises:
        RuntimeError: the child failed (its stderr tail is in the message).
    """
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([python or sys.executable, "-m", "bench.vllm_engine",
                           json.dumps(spec)], cwd=str(ROOT), env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"engine child failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")


class Daemon:
    """A ``kvstore serve`` subprocess on a free loopback port (context manager)."""

    def __init__(self, cpu_bytes: str = "1GiB", python: str | None = None):
        self.cmd = [python or sys.executable, "-m", "kvstore", "serve", "--host", "127.0.0.1",
                    "--port", "0", "--cpu-bytes", cpu_bytes, "--log-level", "warning"]
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> "Daemon":
        self.proc = subprocess.Popen(self.cmd, cwd=str(ROOT), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, PYTHONPATH=str(ROOT)))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                return self
        self.__exit__(None, None, None)
        raise RuntimeError("kvstore serve did not start")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()



if __name__ == "__main__":
    print("RESULT " + json.dumps(child_main(json.loads(sys.argv[1]))), flush=True)
