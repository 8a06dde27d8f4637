"""``make help`` lists every target meant for users, one line each, and only real targets.

The targets are read from make's own database (``make -pq``: the rules as make parsed them,
no recipe run), so a target added to the Makefile without a ``## `` line, or a ``## `` line
left behind on a removed rule, fails here. The default goal stays ``venv``."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make")

pytestmark = pytest.mark.skipif(MAKE is None, reason="GNU make is not installed")


def _make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([MAKE, "--no-print-directory", "-f", str(ROOT / "Makefile"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def _help_lines() -> dict[str, str]:
    """``make help``'s target lines as ``{target: description}``."""
    out = _make("-s", "help")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "make [target] (default: venv)"
    listed = {}
    for line in lines[1:]:
        m = re.fullmatch(r"  ([a-z][a-z0-9-]*) +(\S.*)", line)
        assert m, f"not a target line: {line!r}"
        assert m.group(1) not in listed, f"{m.group(1)} listed twice"
        listed[m.group(1)] = m.group(2)
    return listed


def _database() -> tuple[set[str], set[str], str]:
    """Make's parsed rules: (explicit targets, .PHONY targets, default goal)."""
    out = _make("-pq", "help")  # -q runs no recipe; help is phony, so the exit status is 1
    assert out.returncode in (0, 1), out.stderr
    targets, phony, goal = set(), set(), ""
    for line in out.stdout.splitlines():
        if line.startswith(".DEFAULT_GOAL :="):
            goal = line.split(":=", 1)[1].strip()
        elif line.startswith(".PHONY:"):
            phony.update(line.split(":", 1)[1].split())
        else:
            m = re.match(r"([A-Za-z][A-Za-z0-9_-]*):(?!=)", line)
            if m:
                targets.add(m.group(1))
    return targets, phony, goal


def test_help_lists_exactly_the_user_targets():
    listed = _help_lines()
    targets, phony, goal = _database()
    # every rule with a plain name (not a stamp file under .venv) is meant for users
    user = {t for t in targets if t in phony}
    files = {t for t in targets - phony if (ROOT / t).exists()}  # Makefile itself, say
    assert targets - phony - files == set(), "a plain-named rule that is neither a file nor .PHONY"
    assert {"demo", "test", "test-core", "test-vllm", "gpu-check", "clean", "help"} <= user
    assert set(listed) == user, (f"listed but no phony rule: {sorted(set(listed) - user)}; "
                                 f"rules not listed: {sorted(user - set(listed))}")
    assert goal == "venv"
    for target, text in listed.items():
        assert len(text.split()) >= 3, f"{target}: {text!r} says too little"


def test_help_names_the_durations_of_the_long_targets():
    listed = _help_lines()
    assert re.search(r"\b\d+ min\b", listed["demo"]), listed["demo"]
    assert re.search(r"\b\d+ min\b", listed["test"]), listed["test"]
