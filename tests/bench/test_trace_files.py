"""A trace folder that is not there: one line naming it and where the traces ship, exit 2
(was a FileNotFoundError traceback) in ``bench.policy_sim`` and ``bench.trace_replay``."""
import pytest

from bench import policy_sim, trace_replay
from bench.trace_files import DEFAULT_TRACES_DIR, missing_trace


def _one_line_exit_2(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert "shared/data/traces/" in err and str(DEFAULT_TRACES_DIR) in err
    assert "point --traces-dir at the folder that holds them" in err
    return err


def test_policy_sim_names_a_missing_traces_dir(tmp_path, capsys):
    gone = tmp_path / "nonexist"
    err = _one_line_exit_2(capsys, policy_sim.main,
                           ["--trace", "mooncake-conv", "--traces-dir", str(gone)])
    assert err.startswith(f"python -m bench.policy_sim: error: --traces-dir {gone}: no such "
                          f"directory; the traces ship in the repository's sibling folder")
    err = _one_line_exit_2(capsys, policy_sim.main,   # a folder without the file
                           ["--trace", "mooncake-conv", "--traces-dir", str(tmp_path)])
    assert f"--traces-dir {tmp_path}: no mooncake_conversation_trace.jsonl in it" in err


def test_trace_replay_names_a_missing_traces_dir_or_trace_file(tmp_path, capsys):
    gone = tmp_path / "nonexist"
    for flag in ("--traces-dir", "--trace-dir"):  # the old spelling still works
        err = _one_line_exit_2(capsys, trace_replay.main, [flag, str(gone)])
        assert err.startswith(f"python -m bench.trace_replay: error: --traces-dir {gone}: no "
                              f"such directory")
    err = _one_line_exit_2(capsys, trace_replay.main, ["--trace", str(gone / "t.jsonl")])
    assert f"no trace file {gone / 't.jsonl'};" in err


def test_a_present_trace_file_passes(tmp_path):
    (tmp_path / "t.csv").write_text("x\n")
    assert missing_trace(tmp_path / "t.csv", tmp_path) is None
    assert missing_trace(tmp_path / "u.csv", None).startswith(f"no trace file {tmp_path}")


def test_the_command_prints_the_folder_and_its_trace_files(tmp_path, capsys):
    from bench import policy_trace, trace_files
    assert sorted(trace_files.TRACE_FILES) == sorted(f for f, _ in policy_trace.TRACES.values()) \
        == sorted(trace_replay.TRACES.values())
    for name in trace_files.TRACE_FILES:
        (tmp_path / name).write_text("x" * 10)
    (tmp_path / "SOURCES.md").write_text("s")
    assert trace_files.main(["--traces-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"traces directory: {tmp_path.resolve()}"
    assert "  *           10  mooncake_conversation_trace.jsonl" in out
    assert "               1  SOURCES.md" in out and not any("missing" in line for line in out)
    (tmp_path / "azure_llm_2023_code.csv").unlink()
    assert trace_files.main(["--traces-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "missing: azure_llm_2023_code.csv"
    assert trace_files.main(["--traces-dir", str(tmp_path / "gone")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith(f"--traces-dir {tmp_path.resolve() / 'gone'}: no such directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert trace_files.main(["--traces-dir", str(empty)]) == 1
    assert "no files in it" in capsys.readouterr().out
