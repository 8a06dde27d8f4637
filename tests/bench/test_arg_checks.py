"""Numeric flags and plot paths of the bench scripts are checked when the command line is
parsed: a bad value is argparse's one-line error and exit 2 before any work (the engine and
the simulation are replaced by functions that fail if called)."""
from __future__ import annotations

import argparse

import pytest

from bench.arg_checks import ENGINE_BLOCK_SIZE, chunk_size, int_at_least
from bench.outputs import plot_file


def _no_work(*args, **kwargs):
    raise AssertionError("the benchmark ran before its arguments were checked")


def test_engine_block_size_matches_the_engine_default():
    from engine_min.config import EngineConfig
    assert ENGINE_BLOCK_SIZE == EngineConfig().block_size == 16


def test_int_at_least_and_chunk_size_values():
    assert int_at_least(1)("3") == 3 and int_at_least(0)("0") == 0
    for text, why in (("0", "must be >= 1, got 0"), ("-2", "must be >= 1, got -2"),
                      ("x", "not an integer: 'x'"), ("1.5", "not an integer: '1.5'")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            int_at_least(1)(text)
    assert chunk_size("64") == 64 and chunk_size("16") == 16
    for text in ("7", "0", "-16", "24"):
        with pytest.raises(argparse.ArgumentTypeError,
                           match=f"positive multiple of the engine's block size 16 tokens, "
                                 f"got {int(text)}"):
            chunk_size(text)


def _refused(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,flag", [
    (["--quick", "--max-tokens", "0"], "--max-tokens"),
    (["--quick", "--chunk-size", "7"], "--chunk-size"),
    (["--quick", "--chunk-size", "0"], "--chunk-size"),
    (["--quick", "--cold", "--ttft-rounds", "-1"], "--ttft-rounds"),
    (["--quick", "--seed", "-1"], "--seed"),
])
def test_codec_refuses_bad_numbers_before_loading_the_model(argv, flag, monkeypatch, capsys):
    import engine_min.engine
    monkeypatch.setattr(engine_min.engine, "LLMEngine", _no_work)
    from bench import codec
    monkeypatch.setattr(codec, "workload_prompts", _no_work)
    err = _refused(codec.main, argv, capsys)
    assert f"error: argument {flag}: " in err, err


@pytest.mark.parametrize("argv,flag", [
    (["--quick", "--max-tokens", "-3"], "--max-tokens"),
    (["--quick", "--chunk-size", "40"], "--chunk-size"),
    (["--quick", "--sensitivity", "-1"], "--sensitivity"),
    (["--quick", "--seed", "-5"], "--seed"),
])
def test_codec_study_refuses_bad_numbers_before_loading_the_model(argv, flag, monkeypatch,
                                                                  capsys):
    import engine_min.engine
    monkeypatch.setattr(engine_min.engine, "LLMEngine", _no_work)
    from bench import codec
    monkeypatch.setattr(codec, "workload_prompts", _no_work)
    from bench import codec_study
    err = _refused(codec_study.main, argv, capsys)
    assert f"error: argument {flag}: " in err, err


def test_codec_speed_refuses_a_shape_that_is_not_integers(monkeypatch, capsys):
    from bench import codec_speed
    monkeypatch.setattr(codec_speed, "make_chunk", _no_work)
    err = _refused(codec_speed.main, ["--shape", "30,a,3,64"], capsys)
    assert "--shape must be 4 positive integers L,T,H,D, got '30,a,3,64'" in err, err


def test_plot_file_takes_matplotlib_formats_only(tmp_path):
    for name in ("a.png", "a.PDF", "a.svg"):
        assert plot_file(str(tmp_path / name)) == str(tmp_path / name)
    for name, got in (("x.txt", "the suffix .txt"), ("x", "no suffix"),
                      ("x.json", "the suffix .json")):
        with pytest.raises(argparse.ArgumentTypeError,
                           match=f"has {got}; matplotlib writes only .*\\.png"):
            plot_file(str(tmp_path / name))
    (tmp_path / "d.png").mkdir()
    with pytest.raises(argparse.ArgumentTypeError, match="d.png is a folder"):
        plot_file(str(tmp_path / "d.png"))


def test_policy_sim_refuses_a_png_it_cannot_write_before_simulating(tmp_path, monkeypatch,
                                                                   capsys):
    from bench import policy_sim
    monkeypatch.setattr(policy_sim, "load_chunk_trace", _no_work)
    monkeypatch.setattr(policy_sim, "simulate", _no_work)
    monkeypatch.setattr(policy_sim, "exit_if_missing", lambda *a: None)
    err = _refused(policy_sim.main, ["--trace", "mooncake-synth", "--png",
                                     str(tmp_path / "x.txt")], capsys)
    assert "error: argument --png: " in err and "has the suffix .txt" in err, err


@pytest.mark.parametrize("module,argv,flag", [
    ("long_doc_qa_ttft", ["--chunk-size", "100"], "--chunk-size"),
    ("long_doc_qa_ttft", ["--doc-tokens", "0"], "--doc-tokens"),
    ("long_doc_qa_ttft", ["--threads", "-1"], "--threads"),
    ("long_doc_qa_layerwise", ["--chunk-size", "0"], "--chunk-size"),
    ("long_doc_qa_layerwise", ["--rounds", "1"], "--rounds"),
    ("long_doc_qa_layerwise", ["--question-tokens", "-4"], "--question-tokens"),
])
def test_long_doc_qa_scripts_refuse_bad_numbers_before_loading_the_model(module, argv, flag,
                                                                         monkeypatch, capsys):
    import importlib

    import engine_min.engine
    monkeypatch.setattr(engine_min.engine, "LLMEngine", _no_work)
    bench_module = importlib.import_module(f"bench.{module}")
    monkeypatch.setattr(bench_module, "LLMEngine", _no_work, raising=False)
    err = _refused(bench_module.main, argv, capsys)
    assert f"error: argument {flag}: " in err, err
