"""Shared pytest setup: tests marked ``gpu`` skip unless CUDA (and Triton) are present; the Redis
fixtures of ``tests.redis_fixtures`` are available to every test; engines that do not name a
device run on the CPU (``ENGINE_MIN_DEVICE=cpu``, inherited by the servers tests start), since
the golden outputs and block sizes of the unmarked tests are float32 CPU figures. Tests of a GPU
name ``device="cuda"`` themselves.

Under pytest-xdist (``make test-core`` runs ``-n 2``) each worker process, and every process a
test starts (``OMP_NUM_THREADS``), uses one intra-op torch thread unless the environment already
names a count, so the workers do not oversubscribe the cores.

The shipped GGUF's header (its 49k-token vocabulary) is parsed once per test process: every
in-process ``LLMEngine`` and ``load_tokenizer`` of that file shares one read-only
``gguf.GGUFReader`` (``_share_shipped_gguf_reader``). Any other path, the shipped file once its
size, mtime or inode changed, and a direct call of ``engine_min.weights.open_gguf`` parse it
afresh."""
import functools
import os

import pytest
import torch

os.environ.setdefault("ENGINE_MIN_DEVICE", "cpu")

if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def _share_shipped_gguf_reader() -> None:
    """Wrap the ``open_gguf`` that ``engine_min.engine`` (``LLMEngine``) and
    ``engine_min.tokenizer`` (``load_tokenizer``) call so the shipped model's reader is built
    once per process, keyed by the file's identity (device, inode, size, mtime). The reader
    memory-maps the file read-only and each load copies its tensors out (dequantized), so
    sharing it is invisible to the engines. Errors (a missing or unreadable file) are never
    cached; ``engine_min.weights.open_gguf`` itself is left as it is."""
    import engine_min.engine
    import engine_min.tokenizer
    import engine_min.weights as weights
    try:
        shipped = os.path.realpath(weights.default_model_path())
    except weights.ModelLoadError:
        return
    real = weights.open_gguf

    @functools.lru_cache(maxsize=2)
    def _parsed(key: tuple):
        return real(shipped)

    def open_gguf(path: str):
        try:
            if os.path.realpath(path) == shipped:
                st = os.stat(shipped)
                return _parsed((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        except (OSError, TypeError, ValueError):
            pass
        return real(path)

    open_gguf.__doc__ = real.__doc__
    for mod in (engine_min.engine, engine_min.tokenizer):
        mod.open_gguf = open_gguf


_share_shipped_gguf_reader()

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
