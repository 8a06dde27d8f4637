"""Command line: ``python -m engine_min generate --prompt TEXT [--chat] [--max-tokens N] [--model PATH]
[--device auto|cpu|cuda|cuda:N] [--dtype D]``,
``python -m engine_min serve [flags]`` (see engine_min.serve.cli),
``python -m engine_min route --engines URL,URL,... [flags]`` (the cache-aware router, see
engine_min.router.cli) and
``python -m engine_min export-tokenizer DIR [--model PATH]`` (a Hugging Face tokenizer folder
of the model, for clients that load a tokenizer by path)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_device_args(parser) -> None:
    """``--device`` and ``--dtype`` (checked by ``EngineConfig`` before any model load)."""
    parser.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,cuda:N}",
                        help="where the model, KV pool and sampler run (default auto: "
                        "$ENGINE_MIN_DEVICE when set, else cuda when available, else cpu)")
    parser.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 "
                        "(default: float32 on cpu, float16 on cuda)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine_min", description="engine_min: a minimal "
                                "paged-attention LLM engine")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt and print the completion")
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user chat message")
    g.add_argument("--max-tokens", type=int, default=64, help="most output tokens (default 64)")
    g.add_argument("--model", default=None, help="GGUF file or HF safetensors folder "
                   "(default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    add_device_args(g)
    from engine_min.serve.cli import add_serve_args
    add_serve_args(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))
    from engine_min.router.cli import add_route_args
    add_route_args(sub.add_parser("route", help="cache-aware router in front of several "
                                  "engines (OpenAI-compatible)"))
    x = sub.add_parser("export-tokenizer", help="write the model's tokenizer as a Hugging Face "
                       "tokenizer folder (for clients that load one: vllm bench serve "
                       "--tokenizer DIR, transformers.AutoTokenizer)")
    x.add_argument("dir", help="folder to write (created if missing)")
    x.add_argument("--model", default=None, help="GGUF file or HF safetensors folder "
                   "(default: embedded SmolLM2-135M-Instruct)")
    return p


def export_tokenizer_main(args: argparse.Namespace) -> int:
    """``export-tokenizer DIR``: write the tokenizer folder and print what was written.
    Returns 2 (reason on stderr) when the model cannot be read or DIR cannot be written."""
    from engine_min.identity import model_name
    from engine_min.tokenizer import export_tokenizer, load_tokenizer
    from engine_min.weights import ModelLoadError, default_model_path, gguf_field, open_gguf
    try:
        path = args.model or default_model_path()
        reader = open_gguf(path) if str(path).endswith(".gguf") else None
        tok = load_tokenizer(path, reader)
        model_id, _ = model_name(path, reader)
        if reader is not None:
            arch = gguf_field(reader, "general.architecture")
            ctx = int(gguf_field(reader, f"{arch}.context_length", 0) or 0)
        else:  # a Hugging Face folder: its config.json
            cfg = json.loads((Path(path) / "config.json").read_text())
            arch = cfg.get("model_type", "llama")
            ctx = int(cfg.get("max_position_embeddings") or 0)
        files = export_tokenizer(tok, args.dir, model_id, ctx or 2048, arch or "llama")
    except (ModelLoadError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(files)} of {model_id} to {args.dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 on bad input, with the reason on stderr;
    130 when interrupted by Ctrl-C (``generate``, ``route`` before it listens), with one line
    on stderr; also while the parser imports the commands' modules, which takes seconds)."""
    try:
        return _run_command(build_parser().parse_args(argv))
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback (serve handles its own)
        print("interrupted", file=sys.stderr)
        return 130


def _run_command(args: argparse.Namespace) -> int:
    if args.command == "serve":
        from engine_min.serve.cli import run_serve
        return run_serve(args)
    if args.command == "route":
        from engine_min.router.cli import route_main
        return route_main(args)
    from engine_min.interrupt import sigint_exits
    with sigint_exits():   # one-shot commands: nothing to clean up on Ctrl-C
        if args.command == "export-tokenizer":
            return export_tokenizer_main(args)
        return generate_main(args)


def generate_main(args: argparse.Namespace) -> int:
    """``generate``: load the model, complete ``--prompt`` and print the completion. Returns 2
    (reason on stderr) on a bad flag or a model that cannot be loaded."""
    from engine_min.config import EngineConfig
    from engine_min.engine import LLMEngine
    from engine_min.sampler import SamplingParams
    from engine_min.weights import ModelLoadError
    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device)
        engine = LLMEngine(config)   # (a bad device or dtype is refused above, before the load)
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        out = engine.generate([prompt], sampling)[0]
    except (ValueError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out.text)
    return 0
