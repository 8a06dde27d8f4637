"""Every bench entry point's ``--help`` says how long a run takes on the project's 2-core machine.

Each module of ``bench/`` with a ``main`` is run as ``main(["--help"])`` (argparse prints the help
and exits 0 before any work). Its help must end with a ``Duration on the 2-core machine:``
paragraph that gives a figure with a unit (seconds or minutes), and, when the command has a
``--quick`` form, a figure for that form too. A description taken from the module docstring must
not stop mid-sentence (``store_micro`` and ``prefix_eviction`` printed half a sentence)."""
from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
DURATION = "Duration on the 2-core machine:"
#: a figure with a unit: "12 s", "1.5-3 min", "about 26 minutes", "0.03 s"
FIGURE = re.compile(r"\b\d+(?:[.,]\d+)?(?:-\d+(?:[.,]\d+)?)? ?(?:s|min|minutes|seconds|h)\b")


def _entry_points() -> list[str]:
    """Names of the ``bench`` modules that define a top-level ``main``."""
    names = []
    for path in sorted(BENCH.glob("*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            names.append(path.stem)
    return names


def _help(name: str) -> str:
    """``python -m bench.<name> --help``'s text, whitespace collapsed."""
    module = importlib.import_module(f"bench.{name}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code in (0, None)
    return " ".join(out.getvalue().split())


ENTRY_POINTS = _entry_points()


def test_the_entry_points_are_found():
    assert len(ENTRY_POINTS) >= 20
    assert {"demo", "store_micro", "gpu_check", "multi_round_qa", "policy_sim"} <= set(ENTRY_POINTS)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_says_how_long_a_run_takes(name):
    text = _help(name)
    assert DURATION in text, f"bench.{name} --help has no {DURATION!r} paragraph"
    duration = text[text.index(DURATION) + len(DURATION):]
    assert FIGURE.search(duration), f"bench.{name}: no figure with a unit in {duration!r}"
    if re.search(r"\[--quick\]", text):
        quick = duration.find("--quick")
        assert quick >= 0, f"bench.{name} has --quick but its duration does not mention it"
        assert FIGURE.search(duration[quick:quick + 160]), (
            f"bench.{name}: no figure for --quick in {duration!r}")


@pytest.mark.parametrize("name", ["store_micro", "prefix_eviction"])
def test_one_line_descriptions_are_whole_sentences(name):
    text = _help(name)
    description = text.split(" options: ")[0].split("] ")[-1]
    assert description.rstrip().endswith("."), description
    assert not description.rstrip(" .").endswith((",", " into full")), description
