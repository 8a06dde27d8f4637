"""engine_min: a minimal paged-attention engine (engine -> scheduler -> block manager; model
runner -> model -> kernels).

Importing the package sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already sets it.
OpenMP reads it once, when torch first loads its OpenMP runtime, so it must happen before the
first ``import torch``; ``python -m engine_min`` and ``python -m engine_min.serve.server`` import this
first. On the shared 2-core CPU, OpenMP workers that spin after each parallel region steal the
core the main thread needs next (a 4,024-token prefill measured 30.5 s spinning vs 22 s
passive, same machine and load).
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
