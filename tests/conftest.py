"""Shared pytest setup: tests marked ``gpu`` skip unless CUDA (and Triton) are present."""
import pytest
import torch


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
