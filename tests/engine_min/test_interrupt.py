"""engine_min.interrupt.sigint_exits: inside the block SIGINT ends the process at once (stdout
flushed, one line ``interrupted`` on stderr, status 130) instead of raising KeyboardInterrupt
(unsafe inside torch's import and ops); after the block KeyboardInterrupt is back; an ignored
SIGINT stays ignored. And ``python -m engine_min generate`` interrupted at moments spread over
its start (imports, model load, decoding) always ends that way."""
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _child(body: str, **kw) -> subprocess.CompletedProcess:
    code = "import os, signal, sys\nfrom engine_min.interrupt import sigint_exits\n" + \
        textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, preexec_fn=_default_sigint, **kw)


def _default_sigint() -> None:
    """In the child: SIGINT as a terminal delivers it (a test run in a background job, as CI's,
    would hand the child an ignored SIGINT, which Python and ``sigint_exits`` leave ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_in_the_block_exits_130_with_one_line_and_stdout_flushed():
    r = _child("""
        with sigint_exits():
            print("before", end="")          # buffered (a pipe): must be flushed
            signal.raise_signal(signal.SIGINT)
            print("after")
        """)
    assert r.returncode == 130
    assert r.stdout == "before" and r.stderr == "interrupted\n"


def test_after_the_block_sigint_raises_keyboard_interrupt_again():
    r = _child("""
        with sigint_exits():
            pass
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            print("raised")
        """)
    assert (r.returncode, r.stdout.strip()) == (0, "raised")


def test_an_ignored_sigint_stays_ignored():
    r = _child("""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with sigint_exits():
            signal.raise_signal(signal.SIGINT)
            print("still here")
        """)
    assert (r.returncode, r.stdout.strip()) == (0, "still here")


def test_generate_interrupted_anywhere_in_its_start_exits_130_with_one_line():
    for delay in (0.3, 0.7, 1.0, 1.3, 2.0, 3.5):
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine_min", "generate", "--prompt", "Once upon a time",
             "--max-tokens", "3000", "--device", "cpu"], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
            preexec_fn=_default_sigint)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 130, (delay, proc.returncode, err[-500:])
        assert err == "interrupted\n", (delay, err[-500:])
