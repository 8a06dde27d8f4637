"""A real small filesystem for the full-disk tests: a tmpfs mounted under the test's
``tmp_path`` (root only; the test skips where this process may not mount one)."""
import contextlib
import os
import subprocess
import uuid

import pytest


@contextlib.contextmanager
def mounted_tmpfs(tmp_path, size: str):
    """Yield a directory that is a fresh tmpfs of ``size`` (e.g. ``"512k"``, ``"20m"``),
    unmounted at the end; ``pytest.skip`` without root or where mounting fails."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
