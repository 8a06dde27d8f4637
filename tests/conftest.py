"""Shared pytest setup: tests marked ``gpu`` skip unless CUDA (and Triton) are present; the Redis
fixtures of ``tests.redis_fixtures`` are available to every test."""
import pytest
import torch

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
