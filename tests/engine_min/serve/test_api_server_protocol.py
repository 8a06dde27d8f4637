"""engine_min.serve.protocol, engine_min.serve.responses and engine_min.serve.metrics: validation
rules, wire format and the streaming text hold-back, on plain values (no model, no network)."""
import time

import pytest

from engine_min.serve import protocol as proto
from engine_min.serve import responses as wire
from engine_min.serve.metrics import ServerMetrics


def _err(fn, *args) -> proto.ApiError:
    with pytest.raises(proto.ApiError) as info:
        fn(*args)
    return info.value


def test_completion_request_fields_map_to_sampling():
    req = proto.parse_completion_request({
        "model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
        "top_k": -1, "seed": 7, "stop": "\n", "stop_token_ids": [2], "ignore_eos": True,
        "n": 1, "stream": True, "stream_options": {"include_usage": True},
        "user": "someone"})  # unknown fields are ignored
    assert req == proto.ApiRequest(
        kind="completion", model="m", prompt="hi", max_tokens=5,
        sampling={"stop": ("\n",), "temperature": 0.5, "top_p": 0.9, "top_k": 0, "seed": 7,
                  "stop_token_ids": (2,), "ignore_eos": True},
        stream=True, include_usage=True)


def test_prompt_forms():
    assert proto.parse_completion_request({"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert proto.parse_completion_request({"prompt": ["abc"]}).prompt == "abc"
    assert proto.parse_completion_request({"prompt": [[4, 5]]}).prompt == [4, 5]
    assert _err(proto.parse_completion_request, {"prompt": ["a", "b"]}).code == "unsupported"
    assert _err(proto.parse_completion_request, {"prompt": ""}).code == "empty_prompt"
    assert _err(proto.parse_completion_request, {}).param == "prompt"
    e = _err(proto.parse_completion_request, {"prompt": {"x": 1}})
    assert (e.param, e.code, e.status) == ("prompt", "invalid_type", 400)
    assert _err(proto.parse_completion_request, {"prompt": [1, True]}).code == "invalid_type"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "logprobs": 3}, "logprobs"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "model": 3}, "model"),
    ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
])
def test_bad_completion_fields_are_400(body, param):
    e = _err(proto.parse_completion_request, body)
    assert (e.status, e.type, e.param) == (400, "invalid_request_error", param)


def test_lone_surrogates_and_out_of_range_seeds_are_400_not_500():
    import json
    body = json.loads('{"prompt": "a\\ud800b"}')  # valid JSON, not valid Unicode
    e = _err(proto.parse_completion_request, body)
    assert (e.status, e.param, e.code) == (400, "prompt", "invalid_value")
    assert "lone surrogate '\\ud800' at character 1" in e.message
    for content in ("\udcff", [{"type": "text", "text": "ok \udfff"}]):
        e = _err(proto.parse_chat_request, {"messages": [{"role": "user", "content": content}]})
        assert (e.status, e.param) == (400, "messages[0].content")
    for seed in (2**64, -2**63 - 1):  # torch.Generator.manual_seed overflows on these
        e = _err(proto.parse_completion_request, {"prompt": "x", "seed": seed})
        assert (e.status, e.param, e.code) == (400, "seed", "invalid_value")
    assert proto.parse_completion_request({"prompt": "x", "seed": 2**64 - 1}).sampling["seed"] \
        == 2**64 - 1


def test_chat_messages_and_max_completion_tokens():
    req = proto.parse_chat_request({
        "messages": [{"role": "developer", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}],
        "max_tokens": 9, "max_completion_tokens": 4})
    assert req.messages == [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "ab"}]
    assert (req.kind, req.max_tokens, req.prompt) == ("chat", 4, None)
    assert _err(proto.parse_chat_request, {"messages": []}).param == "messages"
    assert _err(proto.parse_chat_request, {"messages": "hi"}).param == "messages"
    assert _err(proto.parse_chat_request,
                {"messages": [{"role": "wizard", "content": "x"}]}).param == "messages[0].role"
    assert _err(proto.parse_chat_request, {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    ).param == "messages[0].content"


def test_loads_body_rejects_non_objects():
    assert proto.loads_body(b'{"a": 1}') == {"a": 1}
    assert _err(proto.loads_body, b"{not json").code == "invalid_json"
    assert _err(proto.loads_body, b"[1, 2]").code == "invalid_json"
    assert _err(proto.loads_body, b"\xff\xfe").code == "invalid_json"


def test_check_context_limits_and_defaults():
    comp = proto.parse_completion_request({"prompt": "x"})
    assert proto.check_context(comp, [1] * 10, 100, 50) == 16      # completion default
    assert proto.check_context(comp, [1] * 90, 100, 50) == 10      # clipped to the room
    chat = proto.parse_chat_request({"messages": [{"role": "user", "content": "x"}]})
    assert proto.check_context(chat, [1] * 30, 100, 50) == 70      # chat: rest of context
    e = _err(proto.check_context, comp, [1] * 100, 100, 50)
    assert (e.code, e.param) == ("context_length_exceeded", "prompt")
    big = proto.parse_completion_request({"prompt": "x", "max_tokens": 11})
    e = _err(proto.check_context, big, [1] * 90, 100, 50)
    assert (e.code, e.param) == ("context_length_exceeded", "max_tokens")
    assert "101 tokens (90 in the prompt, 11 in the completion)" in e.message
    ids = proto.parse_completion_request({"prompt": [3, 50]})
    assert _err(proto.check_context, ids, [3, 50], 100, 50).message.startswith("Token id 50")


def test_wire_format():
    u = wire.usage(7, 3, 4)
    assert u == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                 "prompt_tokens_details": {"cached_tokens": 4}}
    assert proto.error_body("bad", param="n", code="x") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": "x"}}
    chunk = wire.chat_chunk("id1", "m", 5, {"content": "a"}, None, True)
    assert chunk["usage"] is None and chunk["object"] == "chat.completion.chunk"
    assert wire.sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert wire.SSE_DONE == b"data: [DONE]\n\n"
    assert wire.usage_chunk("id1", "m", 5, "completion", u)["choices"] == []


def test_text_streamer_holds_back_partial_utf8_and_stop_prefixes():
    s = wire.TextStreamer(stop=("END",))
    assert s.delta("Hello", False) == "Hello"
    assert s.delta("Hello E", False) == " "          # "E" may start "END"
    assert s.delta("Hello EN", False) == ""
    assert s.delta("Hello ENx", False) == "ENx"      # not the stop string after all
    assert s.delta("Hello ENx \ufffd", False) == " "  # half a multibyte character
    assert s.delta("Hello ENx \u00e9", True) == "\u00e9"
    assert s.sent == "Hello ENx \u00e9"
    t = wire.TextStreamer(stop=("END",))
    assert t.delta("ab E", False) == "ab "
    assert t.delta("ab ", True) == ""                # engine cut the stop string off


def test_metrics_mirror_cumulative_stats():
    m = ServerMetrics()
    m.update_from_stats({"num_running": 2, "num_waiting": 1, "kv_usage": 0.25,
                         "prefix_cache_queries_tokens": 32, "prefix_cache_hits_tokens": 16})
    m.update_from_stats({"num_running": 0, "num_waiting": 0, "kv_usage": 0.0,
                         "prefix_cache_queries_tokens": 48, "prefix_cache_hits_tokens": 16,
                         "external_prefix_cache_queries": 256,
                         "external_prefix_cache_hits": 0})
    m.ttft.observe(0.2)
    text = m.render()[0].decode()
    for line in ("engine_num_requests_running 0.0", "engine_kv_cache_usage_perc 0.0",
                 "engine_prefix_cache_queries_total 48.0", "engine_prefix_cache_hits_total 16.0",
                 "engine_external_prefix_cache_queries_total 256.0",
                 "engine_external_prefix_cache_hits_total 0.0",
                 'engine_time_to_first_token_seconds_bucket{le="0.25"} 1.0'):
        assert line + "\n" in text, line


def test_each_finish_reason_is_exported_at_zero_before_any_request():
    m = ServerMetrics()
    text = m.render()[0].decode()
    for reason in ("stop", "length", "abort", "error"):
        assert f'engine_request_success_total{{finished_reason="{reason}"}} 0.0\n' in text
    m.request_success.labels("length").inc()
    assert 'engine_request_success_total{finished_reason="length"} 1.0\n' in \
        m.render()[0].decode()


def test_metrics_mirror_the_connectors_stats_as_counters_and_gauges():
    m = ServerMetrics()
    m.update_from_stats({"kvstore_loaded_bytes": 1000, "kvstore_load_fallbacks": 1,
                         "kvstore_hit_tokens_by_tier": {"cpu": 256},
                         "kvstore_load_seconds_sum": 0.5, "kvstore_load_count": 2,
                         "kvstore_load_seconds_max": 0.4, "kvstore_save_queue_bytes": 4096,
                         "kvstore_remote_breaker_open": True})
    m.update_from_stats({"kvstore_loaded_bytes": 3000, "kvstore_load_fallbacks": 1,
                         "kvstore_hit_tokens_by_tier": {"cpu": 256, "disk": 512},
                         "kvstore_load_seconds_sum": 0.75, "kvstore_load_count": 3,
                         "kvstore_load_seconds_max": 0.4, "kvstore_save_queue_bytes": 0,
                         "kvstore_remote_breaker_open": False})
    text = m.render()[0].decode()
    for line in ("engine_kvstore_loaded_bytes_total 3000.0",
                 "engine_kvstore_load_fallbacks_total 1.0",
                 'engine_kvstore_hit_tokens_by_tier_total{tier="cpu"} 256.0',
                 'engine_kvstore_hit_tokens_by_tier_total{tier="disk"} 512.0',
                 "engine_kvstore_load_seconds_total 0.75",
                 "engine_kvstore_load_count_total 3.0",
                 "engine_kvstore_load_seconds_max 0.4",
                 "engine_kvstore_save_queue_bytes 0.0",
                 "engine_kvstore_remote_breaker_open 0.0"):
        assert line + "\n" in text, line


def _args(*argv):
    import argparse

    from engine_min.serve.cli import add_serve_args
    return add_serve_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_serve_flags_defaults_and_sizes():
    a = _args()
    assert (a.host, a.port, a.model, a.kv_cache_bytes, a.kvstore_chunk_size) == \
        ("127.0.0.1", 8000, None, None, None)   # chunk size: the store's default
    a = _args("--kv-cache-bytes", "512MiB", "--kvstore-cpu-bytes", "2GiB",
              "--max-num-batched-tokens", "256", "--max-num-seqs", "4")
    assert (a.kv_cache_bytes, a.kvstore_cpu_bytes) == (512 * 2**20, 2 * 2**30)
    assert (a.max_num_batched_tokens, a.max_num_seqs) == (256, 4)


def test_kvstore_auth_token_flag_reaches_the_daemon_client(monkeypatch):
    from engine_min.serve.cli import build_connector
    monkeypatch.delenv("KVSTORE_AUTH_TOKEN", raising=False)
    assert _args().kvstore_auth_token is None
    from kvstore.config import StoreConfig
    from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
    from kvstore.store import ChunkStore
    store = ChunkStore(StoreConfig(cpu_bytes="1MiB"))
    try:
        with ThreadedServer(create_app(store, ServerLimits(auth_token="s3cret"))) as srv:
            conn = build_connector(_args("--kvstore-url", srv.url,
                                         "--kvstore-auth-token", "s3cret"))
            try:  # a daemon started with --auth-token answers (401 without the token)
                assert conn.store.stats()["tiers"]["cpu"]["capacity_bytes"] == 1 << 20
            finally:
                conn.close()
    finally:
        store.close()
    monkeypatch.setenv("KVSTORE_AUTH_TOKEN", "from-env")
    assert _args().kvstore_auth_token == "from-env"


def test_build_connector_is_none_without_store_flags_and_checks_combinations():
    from engine_min.serve.cli import build_connector
    assert build_connector(_args("--kv-cache-bytes", "64MiB")) is None
    for argv, words in [
        (("--kvstore-disk-bytes", "1GiB"), "needs --kvstore-disk-path"),
        (("--kvstore-url", "ftp://h:1"), "bad --kvstore-\\* flags"),
    ]:
        with pytest.raises(SystemExit, match=words):
            build_connector(_args(*argv))


def test_a_kvstore_disk_path_that_cannot_be_opened_is_a_flag_error_not_a_traceback(tmp_path):
    # a file where the folder should be (named as such) and a lock file that is a folder
    # (IsADirectoryError) were OSErrors that escaped serve as tracebacks
    from engine_min.serve.cli import build_connector
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "d" / "kvstore.lock").mkdir(parents=True)
    for path, reason in [(tmp_path / "a-file",
                          f"disk tier path '{tmp_path / 'a-file'}' is a file, not a directory"),
                         (tmp_path / "d", "[Errno 21] Is a directory")]:
        with pytest.raises(SystemExit) as exc:
            build_connector(_args("--kvstore-disk-path", str(path), "--kvstore-disk-bytes", "1MiB"))
        assert str(exc.value).startswith(f"error: bad --kvstore-* flags: {reason}")


def test_tokenizer_encode_refuses_text_that_is_not_unicode():
    """A lone surrogate (Python's surrogateescape of undecodable argv bytes, or JSON "\\udcff")
    is a ValueError naming it (``generate`` exits 2), not the backend's TypeError."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from engine_min.tokenizer import Tokenizer
    backend = Backend(WordLevel({"hi": 0, "there": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    tok = Tokenizer(backend, eos_token_id=None, bos_token_id=None, chat_template=None)
    assert tok.encode("hi there") == [0, 1]
    with pytest.raises(ValueError, match=r"lone surrogate '\\udcff' at character 3"):
        tok.encode("hi \udcff")


def test_a_port_in_use_or_an_empty_served_name_fails_before_the_model_loads(monkeypatch):
    """Both were found only after the 10-20 s model load (the port as a bind traceback, exit 1);
    now serve_main stops first, with the reason, and never builds an engine."""
    import socket

    from engine_min.serve import cli as serve_cli
    built = []
    monkeypatch.setattr(serve_cli, "build_engine", lambda *a, **k: built.append(a))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            serve_cli.serve_main(_args("--port", str(port)))
        assert str(exc.value).startswith(f"error: cannot listen on 127.0.0.1:{port}: [Errno 98]")
    with pytest.raises(SystemExit) as exc:
        serve_cli.serve_main(_args("--served-model-name", "a", " "))
    assert str(exc.value) == "error: --served-model-name: empty name in ['a', ' ']"
    assert built == []
    serve_cli.check_listen("127.0.0.1", 0)      # port 0: the OS picks one later, nothing to check


@pytest.mark.parametrize("port", [-1, 65536, 99999])
def test_a_port_out_of_range_is_an_error_not_a_traceback(monkeypatch, port):
    from engine_min.serve import cli as serve_cli
    monkeypatch.setattr(serve_cli, "build_engine", lambda *a, **k: pytest.fail("engine built"))
    with pytest.raises(SystemExit) as exc:
        serve_cli.serve_main(_args("--port", str(port)))
    assert str(exc.value) == (f"error: cannot listen on 127.0.0.1:{port}: "
                              "bind(): port must be 0-65535.")


def test_bad_store_flags_exit_2_with_one_error_line_before_the_model_loads(capsys):
    """``python -m engine_min serve`` with store flags that do not go together exits 2, as
    argparse's own usage errors do, with one ``error:`` line and no engine built."""
    from engine_min.cli import main as cli_main
    t0 = time.monotonic()
    assert cli_main(["serve", "--port", "0", "--kvstore-disk-bytes", "1GiB"]) == 2
    assert capsys.readouterr().err == \
        "error: --kvstore-disk-bytes needs --kvstore-disk-path\n"
    assert cli_main(["serve", "--port", "0", "--kvstore-tail-chunk-size", "16"]) == 2
    assert capsys.readouterr().err.startswith("error: --kvstore-tail-chunk-size needs a store")
    # a chunk size that is not a multiple of the engine's block size (16 by default, or
    # --block-size): refused from the flags, not after the model load
    assert cli_main(["serve", "--port", "0", "--kvstore-cpu-bytes", "8MiB",
                     "--kvstore-chunk-size", "100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bad --kvstore-* flags: chunk_size=100 must be a multiple")
    assert cli_main(["serve", "--port", "0", "--kvstore-cpu-bytes", "8MiB", "--block-size", "32",
                     "--kvstore-chunk-size", "64", "--kvstore-tail-chunk-size", "16"]) == 2
    assert "tail_chunk_size=16 must be a multiple" in capsys.readouterr().err
    assert time.monotonic() - t0 < 10          # refused before any model load
