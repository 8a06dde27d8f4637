"""Shared pytest setup: tests marked ``gpu`` skip unless CUDA (and Triton) are present; the Redis
fixtures of ``tests.redis_fixtures`` are available to every test; engines that do not name a
device run on the CPU (``ENGINE_MIN_DEVICE=cpu``, inherited by the servers tests start), since
the golden outputs and block sizes of the unmarked tests are float32 CPU figures. Tests of a GPU
name ``device="cuda"`` themselves.

Under pytest-xdist (``make test-core`` runs ``-n 2``) each worker process, and every process a
test starts (``OMP_NUM_THREADS``), uses one intra-op torch thread unless the environment already
names a count, so the workers do not oversubscribe the cores."""
import os

import pytest
import torch

os.environ.setdefault("ENGINE_MIN_DEVICE", "cpu")

if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# real Redis servers (standalone, 3-master cluster) for the remote tier's tests
pytest_plugins = ["tests.redis_fixtures"]


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
        return True
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and _has_triton():
        return
    skip = pytest.mark.skip(reason="needs CUDA and Triton (CPU-only machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
