"""Output paths of the bench scripts, checked when the command line is parsed, before any
work: a benchmark that ran for minutes must not lose its figures to a path it cannot write.

``output_file`` and ``output_dir`` are argparse ``type=`` functions: a bad path is argparse's
one-line error (``argument --json: ...``) and exit status 2.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path


def _make_dir(folder: Path, what: str) -> None:
    """Create ``folder`` (and its parents) and check it can be written in.

    Raises:
        argparse.ArgumentTypeError: it is a file, cannot be created or is not writable.
    """
    if folder.exists() and not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{what} {folder} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"cannot create the folder {folder}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write in the folder {folder}")


def output_file(text: str) -> str:
    """An argparse type: a file path the script can write (its folder created if missing);
    returned unchanged.

    Raises:
        argparse.ArgumentTypeError: an empty path, a folder, a folder that cannot be created
            or written in, or an existing file that is not writable.
    """
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file path")
    _make_dir(path.parent, "the parent")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}")
    return text


def output_dir(text: str) -> str:
    """An argparse type: a folder the script can write in (created if missing); returned
    unchanged.

    Raises:
        argparse.ArgumentTypeError: an empty path, a file, or a folder that cannot be created
            or written in.
    """
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    _make_dir(Path(text), "")
    return text


def plot_file(text: str) -> str:
    """An argparse type: a file path matplotlib can write a figure to, its suffix one of the
    formats matplotlib saves (``.png``, ``.pdf``, ``.svg``, ...; no suffix is refused, since
    matplotlib would then write ``<path>.png``); checked as ``output_file`` too. Returned
    unchanged.

    Raises:
        argparse.ArgumentTypeError: a suffix matplotlib cannot write, no suffix, or any of
            ``output_file``'s reasons.
    """
    from matplotlib.backend_bases import FigureCanvasBase
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = Path(text).suffix.lower().lstrip(".")
    if suffix not in formats:
        got = f"the suffix .{suffix}" if suffix else "no suffix"
        raise argparse.ArgumentTypeError(
            f"{text} has {got}; matplotlib writes only {', '.join('.' + f for f in formats)}")
    return output_file(text)
