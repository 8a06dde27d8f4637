"""KVStoreConnector on the real vLLM engine (CPU build): two engine processes share a prompt's
KV through one ``kvstore serve`` daemon.

Skipped unless vLLM imports in the running interpreter; run it in the vLLM environment::

    tools/make_vllm_env.sh && .venv-vllm/bin/python -m pytest -q tests/connectors/test_vllm_daemon.py

Engine starts: three fresh engine processes (the no-connector baseline, shared with
``test_vllm_connector.py`` when both run in one pytest process; two engines on one daemon,
prefix caching on then off).
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (tools/make_vllm_env.sh)")

from bench.vllm_engine import Daemon, run_child  # noqa: E402
from tests.connectors.vllm_fixtures import (  # noqa: E402, F401 - fixtures used by name
    BLOCK, CHUNK, MAX_TOKENS, baseline, chat, model_dir, prompts)

pytestmark = pytest.mark.slow


def test_two_engine_processes_share_prefix_through_daemon(model_dir, prompts, baseline):
    with Daemon("512MiB") as d:
        common = {"model_dir": model_dir, "connector": "ours-daemon", "url": d.url,
                  "max_tokens": MAX_TOKENS, "prompts": [prompts["P"]], "warmup": False}
        a = run_child({**common, "prefix_caching": True})
        b = run_child({**common, "prefix_caching": False})
    ra, rb = a["results"][0], b["results"][0]
    assert ra["output_ids"] == baseline["P"] and rb["output_ids"] == baseline["P"]
    wa, wb = a["connector"]["worker"], b["connector"]["worker"]
    assert wa["saved_chunks"] == 4 and wa["saved_tail_chunks"] == 1 and wa["loaded_tokens"] == 0
    assert wb["loaded_tokens"] == 4 * CHUNK + BLOCK and wb["load_errors"] == 0
    assert wb["saved_chunks"] == 0 and wb["remote"] is True
    assert rb["ttft_s"] < ra["ttft_s"], (rb["ttft_s"], ra["ttft_s"])
