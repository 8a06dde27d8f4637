"""The OpenMP wait policy: set by the entry points, never by importing engine_min."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**base, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


def test_importing_engine_min_and_its_server_leaves_the_environment_alone():
    code = ("import os; before = dict(os.environ); import engine_min, engine_min.engine, "
            "engine_min.serve.server, engine_min.serve.cli; print(dict(os.environ) == before, "
            "os.environ.get('OMP_WAIT_POLICY'))")
    assert _run(code) == "True None"


def test_the_entry_point_sets_passive_unless_the_environment_chose():
    code = ("from engine_min.omp import set_omp_wait_policy; import os; "
            "print(set_omp_wait_policy(), os.environ['OMP_WAIT_POLICY'])")
    assert _run(code) == "PASSIVE PASSIVE"
    assert _run(code, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE ACTIVE"


def test_python_m_engine_min_sets_it_before_torch_is_imported():
    code = ("import runpy, sys, os; sys.argv = ['engine_min', '--help']\n"
            "try:\n    runpy.run_module('engine_min', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    assert _run(code).splitlines()[-1] == "PASSIVE False"
