"""The served model name (issue: clients that load a tokenizer by model name fail on the GGUF
file's stem), on the real SmolLM2-135M model:

* the default served name is the model's own id from its metadata,
  ``HuggingFaceTB/SmolLM2-135M-Instruct`` (was ``SmolLM2-135M-Instruct.Q4_1``), or ``--model-id``;
* ``--served-model-name`` takes several names as vLLM's: ``/v1/models`` lists each, a request
  may name any, responses report the first, an unknown name is a 404 OpenAI error object;
* ``python -m engine_min export-tokenizer DIR`` writes a Hugging Face tokenizer folder that
  ``transformers.AutoTokenizer`` loads and that tokenizes and renders chats exactly like the
  engine's tokenizer, so ``vllm bench serve --tokenizer DIR`` works offline;
* the startup log names the model, its weights fingerprint and the store namespace.
"""
from __future__ import annotations

import argparse
import json
import logging

import pytest

from engine_min.cli import main as cli_main
from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.serve.cli import add_serve_args, log_identity, served_model_names
from engine_min.serve.server import ServerThread, create_app
from tests.engine_min.serve.http_json import call_json

SHIPPED_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
NAMES = ["smollm2", SHIPPED_ID, "alias-b"]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(kv_cache_bytes=32 << 20, block_size=16, max_model_len=256))


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(create_app(engine, NAMES)) as srv:
        yield srv


def _args(*argv: str) -> argparse.Namespace:
    return add_serve_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_default_served_name_is_the_models_metadata_id(engine):
    assert engine.kv_identity["model_id"] == SHIPPED_ID
    assert served_model_names(_args(), engine) == [SHIPPED_ID]
    assert served_model_names(_args("--served-model-name", "a", "b", "a"), engine) == ["a", "b"]
    with pytest.raises(ValueError, match="empty name"):
        served_model_names(_args("--served-model-name", " "), engine)


def test_model_id_flag_is_the_default_served_name(engine):
    """``--model-id`` names the model; without --served-model-name it is the served name."""
    named = LLMEngine(EngineConfig(kv_cache_bytes=8 << 20, model_id="acme/smol"))
    assert named.kv_identity["model_id"] == "acme/smol"
    assert named.kv_identity["weights_fingerprint"] == engine.kv_identity["weights_fingerprint"]
    assert served_model_names(_args("--model-id", "acme/smol"), named) == ["acme/smol"]


def test_v1_models_lists_every_served_name(server):
    status, body = call_json(server, "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == NAMES
    assert {m["root"] for m in body["data"]} == {"smollm2"}
    assert {m["max_model_len"] for m in body["data"]} == {256}


@pytest.mark.parametrize("model", ["alias-b", SHIPPED_ID, None])
def test_any_served_name_is_accepted_and_the_first_is_reported(server, model):
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    if model is not None:
        body["model"] = model
    status, out = call_json(server, "/v1/completions", body)
    assert status == 200 and out["model"] == "smollm2"
    status, out = call_json(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        **({"model": model} if model else {})})
    assert status == 200 and out["model"] == "smollm2"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_a_404_openai_error(server, route):
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 2, "prompt": "x",
            "messages": [{"role": "user", "content": "x"}]}
    status, out = call_json(server, route, body)
    assert status == 404
    err = out["error"]
    assert err["message"] == "The model `SmolLM2-135M-Instruct.Q4_1` does not exist."
    assert err["param"] == "model" and err["code"] == "model_not_found"
    status, _ = call_json(server, route, {**body, "model": "smollm2"})  # still serving
    assert status == 200


# ---- the tokenizer for clients -------------------------------------------------------------
TEXTS = ["Hello world", "  two  spaces\nand a newline, 12345 digits, 3.14",
         "<|im_start|>user\nhi<|im_end|>\n", "héllo wörld 世界 🚀", "def f(x):\n\treturn x**2", ""]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    assert cli_main(["export-tokenizer", str(out)]) == 0
    return out


def test_export_tokenizer_writes_a_hf_folder(exported):
    assert sorted(p.name for p in exported.iterdir()) == \
        ["config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((exported / "config.json").read_text()) == {
        "model_type": "llama", "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2,
        "max_position_embeddings": 8192}
    cfg = json.loads((exported / "tokenizer_config.json").read_text())
    assert cfg["name_or_path"] == SHIPPED_ID and cfg["model_max_length"] == 8192
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == \
        ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert cfg["chat_template"].startswith("{% for message in messages %}")


def test_autotokenizer_tokenizes_and_renders_like_the_engine(exported, engine):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(exported))
    ours = engine.tokenizer
    for text in TEXTS:
        ids = ours.encode(text)
        assert hf.encode(text) == ids, text
        assert hf(text)["input_ids"] == ids, text           # add_special_tokens=True: no BOS
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids), text
    assert hf.encode("Hello world") == [19556, 905]
    for chat in CHATS:
        text = ours.apply_chat_template(chat)
        assert hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == text
        rendered = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        assert ids == ours.encode(text)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 2)
    assert len(hf) == ours.vocab_size == 49152


def test_export_tokenizer_into_a_file_path_fails_clearly(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert cli_main(["export-tokenizer", str(blocker / "sub")]) == 2
    assert "error:" in capsys.readouterr().err


def test_export_tokenizer_where_tokenizer_json_cannot_be_written_fails_clearly(tmp_path, capsys):
    # tokenizers' own save raises a plain Exception (not OSError) for an I/O error: it used to
    # escape as a traceback instead of an "error:" line and exit status 2
    (tmp_path / "tokenizer.json").mkdir()
    assert cli_main(["export-tokenizer", str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (f"error: cannot write {tmp_path / 'tokenizer.json'}: "
                       f"Is a directory (os error 21)\n")


# ---- startup log -----------------------------------------------------------------------------
def test_startup_log_names_model_fingerprint_and_namespace(engine, caplog):
    from connectors.factory import create_connector
    conn = create_connector(cpu_bytes="16MiB", chunk_size=16)
    fp = engine.kv_identity["weights_fingerprint"]
    with caplog.at_level(logging.INFO):
        engine.set_connector(conn)
        log_identity(engine, NAMES)
    try:
        text = caplog.text
        assert f"model {SHIPPED_ID} (revision -, weights {fp}), served as smollm2, " \
            f"{SHIPPED_ID}, alias-b" in text
        assert f"kvstore namespace: {SHIPPED_ID} revision=- weights={fp} kv_dtype=float32 " \
            f"chunk_size=16 compute_dtype=float32 " \
            f'rope={{"scaling":null,"theta":100000.0}} ns_id={conn.ns.ns_id.hex()}' in text
        assert conn.ns.weights_fingerprint == fp and conn.ns.model_id == SHIPPED_ID
    finally:
        engine.set_connector(None)
        conn.close()
