"""vLLM's KVStoreConnector with a read-only daemon token, end to end: a ``kvstore serve`` daemon
started with a tenants file (a writer tenant, a reader bound to the writer's salt, an admin
that reads the daemon's counters), a vLLM engine with the writer's token, then one with the
reader's token.

The reader's engine loads the writer's chunks of the same prompt and answers exactly as the
writer and as vLLM without any connector; on prompts the store does not hold (a 2-round chat
on another document) it answers as vLLM alone and the daemon receives no write: no chunk is
stored, no put (or other write) is sent, no request is refused, and the connector counts and
logs no error.

Skipped unless vLLM imports in the running interpreter; run it in the vLLM environment::

    .venv-vllm/bin/python -m pytest -q tests/connectors/test_vllm_reader.py

Engine starts: two fresh engine processes (writer, reader), plus the no-connector baseline
shared with ``test_vllm_connector.py`` and ``test_vllm_daemon.py`` in one pytest process.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (tools/make_vllm_env.sh)")

from bench.vllm_engine import ROOT, Daemon  # noqa: E402
from kvstore.daemon.client import KVStoreClient  # noqa: E402
from tests.connectors.vllm_fixtures import (  # noqa: E402, F401 - fixtures used by name
    BLOCK, CHUNK, MAX_TOKENS, ROUND1_TOKENS, baseline, chat, model_dir, prompts)

pytestmark = pytest.mark.slow
TOKENS = {"alice": "alice-token-0123456789", "dash": "dash-token-0123456789ab",
          "ops": "ops-token-0123456789abcd"}
#: daemon routes that write (HTTP ``/v1/<name>``, same-host ``shm_<name>``)
WRITE_ROUTES = {"put", "remove", "demote", "clear", "stage"}
_REQUESTS = re.compile(r'^kvstore_server_requests_total\{route="([^"]*)",status="(\d+)"\} '
                       r'(\S+)$')


def _engine(spec: dict) -> tuple[dict, str]:
    """``bench.vllm_engine``'s child on ``spec`` (as ``run_child``), keeping its stderr:
    ``(result, stderr)``.

    Raises:
        RuntimeError: the child failed (its stderr tail is in the message).
    """
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "bench.vllm_engine", json.dumps(spec)],
                          cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=600)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:]), proc.stderr
    raise RuntimeError(f"engine child failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")


def _daemon_counts(admin: KVStoreClient) -> dict:
    """The daemon's chunks and counters as its admin reads them: ``chunks`` (held, all
    tiers), ``stored`` (chunks newly stored by puts), ``hits`` (chunks served by gets),
    ``writes`` (requests on write routes), ``refused`` (answers with status >= 400 on any
    route but ``/v1/stats``, which only an admin may read: a tenant's client that asks for
    the aggregates is refused there)."""
    st = admin.stats()
    out = {"chunks": sum(t["num_chunks"] for t in st["tiers"].values()),
           "stored": st["stored_chunks"], "hits": st["hits"], "writes": 0, "refused": 0}
    for line in admin.metrics_text().splitlines():
        m = _REQUESTS.match(line)
        if m is None:
            continue
        route, status, n = m.group(1), int(m.group(2)), int(float(m.group(3)))
        name = route.rsplit("/", 1)[-1].removeprefix("shm_")
        out["writes"] += n if name in WRITE_ROUTES else 0
        out["refused"] += n if status >= 400 and route != "/v1/stats" else 0
    return out


def _kvstore_warnings(stderr: str) -> list[str]:
    """The child's log lines at WARNING or above from our loggers, and any line naming a
    403 answer."""
    return [ln for ln in stderr.splitlines()
            if "403" in ln or ("kvstore" in ln.lower()
                               and re.search(r"\b(WARNING|ERROR|CRITICAL)\b", ln))]


def test_vllm_with_a_reader_token_loads_the_writers_prefix_and_writes_nothing(
        model_dir, prompts, chat, baseline, tmp_path):
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {
        "alice": {"token": TOKENS["alice"]},
        "dash": {"token": TOKENS["dash"], "role": "reader", "salt": "alice"},
        "ops": {"token": TOKENS["ops"], "role": "admin"}}}))
    daemon = Daemon("512MiB")
    daemon.cmd += ["--tenants-file", str(tenants)]
    with daemon:
        admin = KVStoreClient(daemon.url, auth_token=TOKENS["ops"], same_host=False,
                              timeout_s=10)
        common = {"model_dir": model_dir, "connector": "ours-daemon", "url": daemon.url,
                  "max_tokens": MAX_TOKENS, "warmup": False}
        before = _daemon_counts(admin)
        w, w_err = _engine({**common, "prompts": [prompts["P"]],
                            "extra": {"auth_token": TOKENS["alice"]}})
        after_w = _daemon_counts(admin)
        r, r_err = _engine({**common, "prompts": [prompts["P"]],
                            "chats": [[chat["U1"], chat["U2"]]],
                            "chat_max_tokens": [ROUND1_TOKENS, MAX_TOKENS],
                            "extra": {"auth_token": TOKENS["dash"]}})
        after_r = _daemon_counts(admin)
        admin.close()
    # the writer stores P's 4 full chunks and one tail piece
    ww = w["connector"]["worker"]
    assert (ww["saved_chunks"], ww["saved_tail_chunks"], ww["loaded_tokens"]) == (4, 1, 0)
    assert after_w["chunks"] - before["chunks"] == 5 and after_w["refused"] == 0
    assert after_w["writes"] > before["writes"] and after_w["stored"] - before["stored"] == 5
    assert w["results"][0]["output_ids"] == baseline["P"]
    # (a) the reader loads them for P and answers exactly as the writer and vLLM alone
    rp = r["results"][0]
    assert rp["connector"]["worker"]["loaded_tokens"] == 4 * CHUNK + BLOCK
    assert rp["output_ids"] == w["results"][0]["output_ids"] == baseline["P"]
    assert after_r["hits"] - after_w["hits"] == 5
    # (b) on the chat (nothing of it stored) it answers as vLLM alone and saves nothing
    assert [x["output_ids"] for x in r["chats"][0]] == baseline["chat"]
    rw, rs = r["connector"]["worker"], r["connector"]["scheduler"]
    assert rw["loaded_tokens"] == 4 * CHUNK + BLOCK   # P's prefix only
    assert (rw["saved_chunks"], rw["saved_tail_chunks"], rw["dropped_saves"],
            rw["demoted_tail_chunks"]) == (0, 0, 0, 0)
    assert (rw["save_errors"], rw["demote_errors"], rw["load_errors"],
            rs["lookup_errors"]) == (0, 0, 0, 0)
    assert rs["lookups"] >= 3 and rw["remote"] is True
    # the daemon holds and stored exactly what it had, received no write, refused nothing
    assert {k: after_r[k] for k in ("chunks", "stored", "writes", "refused")} == \
        {k: after_w[k] for k in ("chunks", "stored", "writes", "refused")}
    assert _kvstore_warnings(w_err) == [] and _kvstore_warnings(r_err) == []
