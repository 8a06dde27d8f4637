"""Do standard clients measure ``engine_min serve`` as the server measures itself?
``python -m bench.client_parity [--json]``

Runs ``vllm bench serve`` (vLLM's own benchmark client, from ``.venv-vllm``; build it with
``make vllm-venv``) against ``engine_min serve`` (started here, from this environment) on a
shared-prefix workload (vllm bench's ``prefix_repetition`` dataset: ``--num-prefixes`` random
prefixes of ``--prefix-len`` tokens, each followed by its own ``--suffix-len``-token suffix,
``--num-prompts`` requests, ``--output-len`` tokens each with ``ignore_eos``), through both of
its OpenAI backends (``openai`` on ``/v1/completions``, ``openai-chat`` on
``/v1/chat/completions``), with and without a KV store (``engine-cache``: the engine's own
prefix cache; ``kvstore-cpu``: plus ``--kvstore-cpu-bytes``; both on the same small KV pool).

For each run it reports the client's mean TTFT (``mean_ttft_ms`` of vllm bench's result file),
the server's (``server_ttft_mean_ms``: the increase of ``engine_time_to_first_token_seconds``'s
``_sum`` over that of its ``_count`` across the run, from ``/metrics``), the requests vllm bench
counted as failed, whether it could check its prompts' token counts through ``/tokenize``
(``aligned``; its log says ``/tokenize unavailable, skipping alignment`` when a server lacks the
route) and whether the server counted them differently (``realigned``: vllm bench then cut the
prompts to length through ``/detokenize``). The two TTFTs
differ by the HTTP round trip and the SSE write, so a large gap is a measurement bug (a chat
stream that sent its first chunk before prefill read ~10 ms on the client).

vllm bench needs a tokenizer it can load locally (the served name, the model's Hugging Face
id, is not downloaded here): ``--tokenizer DIR`` takes a Hugging Face tokenizer folder; without
it ``python -m engine_min export-tokenizer`` writes the engine's own once to
``results/client_parity/tokenizer``.

Output (``--json``): ``{"runs": {"<config>/<backend>": {"ttft_mean_ms", "server_ttft_mean_ms",
"failed", "completed", "server_ttft_count", "aligned", "realigned", "wall_s"}}, "workload":
{...}, "commands": {...}}`` (TTFTs in milliseconds, ``wall_s`` in seconds).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.arg_checks import byte_size, int_at_least
from bench.metrics_scrape import parse_metrics
from bench.servers import ServerGroup, ServerOptions, install_cleanup_handlers

ROOT = Path(__file__).resolve().parent.parent
VLLM_BIN = ROOT / ".venv-vllm" / "bin" / "vllm"
TTFT = "engine_time_to_first_token_seconds"
BACKENDS = {"completions": ("openai", "/v1/completions"),
            "chat": ("openai-chat", "/v1/chat/completions")}
CONFIGS = ("engine-cache", "kvstore-cpu")


@dataclass(frozen=True)
class Workload:
    """The shared-prefix dataset and load of every run (token counts; vllm bench's flags)."""

    num_prompts: int = 32
    num_prefixes: int = 4
    prefix_len: int = 192
    suffix_len: int = 32
    output_len: int = 8
    max_concurrency: int = 4
    seed: int = 0

    def vllm_args(self) -> list[str]:
        return ["--dataset-name", "prefix_repetition",
                "--prefix-repetition-num-prefixes", str(self.num_prefixes),
                "--prefix-repetition-prefix-len", str(self.prefix_len),
                "--prefix-repetition-suffix-len", str(self.suffix_len),
                "--prefix-repetition-output-len", str(self.output_len),
                "--num-prompts", str(self.num_prompts), "--max-concurrency",
                str(self.max_concurrency), "--request-rate", "inf", "--seed", str(self.seed),
                "--ignore-eos", "--temperature", "0", "--disable-tqdm"]


#: the smallest value of each ``Workload`` field's flag (the seed: any integer)
WORKLOAD_MINIMUMS = {"num_prompts": 1, "num_prefixes": 1, "prefix_len": 1, "suffix_len": 0,
                     "output_len": 1, "max_concurrency": 1}


def ttft_histogram(metrics_text: str) -> tuple[float, float]:
    """``(count, sum in seconds)`` of the server's TTFT histogram in a ``/metrics`` text.

    Raises:
        KeyError: the text has no ``engine_time_to_first_token_seconds`` histogram.
    """
    samples = parse_metrics(metrics_text)
    return samples[f"{TTFT}_count"], samples[f"{TTFT}_sum"]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read()


def ensure_tokenizer(path: Path) -> Path:
    """A Hugging Face tokenizer folder of the served model at ``path``, written by ``python -m
    engine_min export-tokenizer`` unless one is there.

    Raises:
        subprocess.CalledProcessError: the export failed.
    """
    if not (path / "tokenizer.json").is_file():
        subprocess.run([sys.executable, "-m", "engine_min", "export-tokenizer", str(path)],
                       check=True, capture_output=True, timeout=600)
    return path


def run_vllm_bench(base_url: str, backend: str, tokenizer: Path, work: Workload,
                   out_dir: Path) -> tuple[dict, str, list[str]]:
    """One ``vllm bench serve`` run; (its result JSON, its output, the command).

    Raises:
        RuntimeError: vllm bench exited non-zero (message has its output's tail).
    """
    model = json.loads(_get(base_url + "/v1/models"))["data"][0]["id"]
    name, endpoint = BACKENDS[backend]
    result = out_dir / f"{backend}.json"
    cmd = [str(VLLM_BIN), "bench", "serve", "--backend", name, "--base-url", base_url,
           "--endpoint", endpoint, "--model", model, "--tokenizer", str(tokenizer),
           *work.vllm_args(), "--save-result", "--result-dir", str(out_dir),
           "--result-filename", result.name]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{output[-3000:]}")
    return json.loads(result.read_text()), output, cmd


def one_run(config: str, backend: str, opts: ServerOptions, tokenizer: Path,
            work: Workload, out_dir: Path) -> tuple[dict, str]:
    """A fresh server of ``config``, one vllm bench run through ``backend``; (row, command)."""
    with ServerGroup(config, opts) as group:
        url = group.engine_urls[0]
        before = ttft_histogram(_get(url + "/metrics").decode())
        result, output, cmd = run_vllm_bench(url, backend, tokenizer, work, out_dir)
        after = ttft_histogram(_get(url + "/metrics").decode())
    count, sum_s = after[0] - before[0], after[1] - before[1]
    row = {"ttft_mean_ms": round(float(result["mean_ttft_ms"]), 1),
           "server_ttft_mean_ms": round(1000 * sum_s / count, 1) if count else None,
           "failed": int(result["failed"]), "completed": int(result["completed"]),
           "server_ttft_count": int(count),
           "aligned": "/tokenize unavailable" not in output,
           "realigned": "tokenizer mismatch" in output}
    return row, " ".join(cmd)


_DURATION = ("Duration on the 2-core machine: the default run (4 vllm bench runs of 32 requests)\n"
             "166 s wall (nice 19, load average 2.4-5.0 from other work, 2026-12-02).")


def build_parser() -> argparse.ArgumentParser:
    """The command line (numeric flags checked as it is parsed: ``bench.arg_checks``)."""
    ap = argparse.ArgumentParser(epilog=_DURATION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 prog="python -m bench.client_parity",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="Hugging Face tokenizer folder for vllm bench (default: the engine's, "
                    "exported to results/client_parity/tokenizer)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument("--kv-cache-bytes", type=byte_size, default="32MiB",
                    help="engine KV pool (default 32MiB)")
    ap.add_argument("--kvstore-cpu-bytes", type=byte_size, default="512MiB")
    for f in Workload.__dataclass_fields__.values():
        least = WORKLOAD_MINIMUMS.get(f.name)
        ap.add_argument("--" + f.name.replace("_", "-"), default=f.default,
                        type=int if least is None else int_at_least(least))
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not VLLM_BIN.exists():
        raise SystemExit(f"{VLLM_BIN} not found: build the vLLM environment (make vllm-venv)")
    install_cleanup_handlers()
    work = Workload(**{k: getattr(args, k) for k in Workload.__dataclass_fields__})
    tokenizer = ensure_tokenizer(args.tokenizer or ROOT / "results/client_parity/tokenizer")
    opts = ServerOptions(kv_cache_bytes=args.kv_cache_bytes,
                         kvstore_cpu_bytes=args.kvstore_cpu_bytes)
    runs, commands = {}, {}
    with tempfile.TemporaryDirectory(prefix="client-parity-") as tmp:
        for config in args.configs:
            for backend in args.backends:
                t0 = time.monotonic()
                row, cmd = one_run(config, backend, opts, tokenizer, work, Path(tmp))
                row["wall_s"] = round(time.monotonic() - t0, 1)
                runs[f"{config}/{backend}"] = row
                commands[f"{config}/{backend}"] = cmd
                if not args.json:
                    print(f"{config}/{backend}: {row}", flush=True)
    report = {"runs": runs, "workload": work.__dict__, "commands": commands}
    if args.json:
        print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
