"""Output paths of the bench scripts are checked when the command line is parsed: a path that
cannot be written is argparse's one-line error and exit 2 before any work (the benchmark
functions are replaced by ones that fail if called)."""
from __future__ import annotations

import argparse
import os

import pytest

from bench.outputs import output_dir, output_file


def test_output_file_creates_its_folder_and_refuses_what_cannot_be_written(tmp_path):
    target = tmp_path / "a" / "b" / "x.json"
    assert output_file(str(target)) == str(target)
    assert target.parent.is_dir() and not target.exists()
    assert output_file("x.json") == "x.json"          # the working folder
    for bad, why in (("/proc/nope/x.json", "cannot create the folder /proc/nope: "),
                     (str(tmp_path), f"{tmp_path} is a folder; give a file path"),
                     ("", "an empty path")):
        with pytest.raises(argparse.ArgumentTypeError) as err:
            output_file(bad)
        assert str(err.value).startswith(why), str(err.value)
    (tmp_path / "f").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="is a file, not a folder"):
        output_file(str(tmp_path / "f" / "x.json"))
    if os.geteuid() != 0:        # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(argparse.ArgumentTypeError, match="cannot write in the folder"):
            output_file(str(ro / "x.json"))


def test_output_dir_creates_it_and_refuses_a_file(tmp_path):
    assert output_dir(str(tmp_path / "p" / "q")) == str(tmp_path / "p" / "q")
    assert (tmp_path / "p" / "q").is_dir()
    (tmp_path / "f").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match=" is a file, not a folder"):
        output_dir(str(tmp_path / "f"))
    with pytest.raises(argparse.ArgumentTypeError, match="cannot create the folder /proc/x"):
        output_dir("/proc/x/plots")


def _no_work(*args, **kwargs):
    raise AssertionError("the benchmark ran before its output path was checked")


@pytest.mark.parametrize("argv", [["--quick", "--json", "/proc/nope/x.json"],
                                  ["--quick", "--json", "{tmp}"]])
def test_store_micro_refuses_a_bad_json_path_before_running(argv, tmp_path, monkeypatch,
                                                            capsys):
    from bench import store_micro
    for name in dir(store_micro):
        if name.startswith("bench_") and callable(getattr(store_micro, name)):
            monkeypatch.setattr(store_micro, name, _no_work)
    monkeypatch.setattr(store_micro, "ChunkStore", _no_work, raising=False)
    with pytest.raises(SystemExit) as exit_:
        store_micro.main([a.format(tmp=tmp_path) for a in argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("store_micro.py: error: argument --json: ") or \
        "error: argument --json: " in err, err


def test_replay_scripts_check_json_plots_and_log_paths(tmp_path, monkeypatch, capsys):
    from bench import multi_round_qa
    monkeypatch.setattr(multi_round_qa, "run_configs", _no_work)
    (tmp_path / "f").write_text("")
    for flag, value in (("--json", str(tmp_path)), ("--plots-dir", str(tmp_path / "f")),
                        ("--log-dir", "/proc/nope/logs")):
        with pytest.raises(SystemExit) as exit_:
            multi_round_qa.main([flag, value])
        assert exit_.value.code == 2
        assert f"error: argument {flag}: " in capsys.readouterr().err
    args = multi_round_qa.build_parser().parse_args(
        ["--json", str(tmp_path / "new" / "r.json"), "--plots-dir", str(tmp_path / "plots")])
    assert args.json == str(tmp_path / "new" / "r.json") and (tmp_path / "new").is_dir()
    assert (tmp_path / "plots").is_dir()
