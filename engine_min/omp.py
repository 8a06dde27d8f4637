"""The OpenMP wait policy of the engine's processes, set by their entry points.

``set_omp_wait_policy()`` sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already
sets a policy. OpenMP (libgomp) reads it once, when torch first loads its OpenMP runtime (at
``import torch``), so an entry point calls it before torch is imported: ``python -m
engine_min``, ``python -m engine_min.serve.server`` and the engine benchmarks
(``bench/engine_speed.py``, ``bench/long_doc_qa_ttft.py``). Importing ``engine_min`` changes
nothing. On a shared 2-core CPU, OpenMP workers that spin after each parallel region steal the
core the main thread needs next (a 4,024-token prefill measured 30.5 s spinning vs 22 s
passive, same machine and load).
"""
from __future__ import annotations

import os


def set_omp_wait_policy(policy: str = "PASSIVE") -> str:
    """Set ``OMP_WAIT_POLICY`` to ``policy`` unless already set; returns the value in force.

    Takes effect only if called before torch loads OpenMP (before ``import torch``)."""
    return os.environ.setdefault("OMP_WAIT_POLICY", policy)
