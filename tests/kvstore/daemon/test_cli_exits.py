"""``kvstore stats``/``clear`` exit statuses and messages as the README states them: 0 done, 2
bad usage or input (an unknown flag reported with its subcommand's usage, not the top-level
one), 1 a daemon unreachable, refusing the token (with a hint naming ``--auth-token`` and
``$KVSTORE_AUTH_TOKEN``) or not a kvstore daemon; ``clear --json`` prints one JSON object."""
import http.server
import json
import socket
import threading

import pytest

from kvstore.daemon import cli
from kvstore.daemon.client import KVStoreClient
from tests.kvstore.daemon.server_helpers import KEYS, NS, chunk, token_daemon

TOKEN = "exit-codes-token-0123"


@pytest.fixture()
def daemon():
    with token_daemon(TOKEN) as pair:
        yield pair


@pytest.fixture()
def no_env_token(monkeypatch):
    monkeypatch.delenv("KVSTORE_AUTH_TOKEN", raising=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_clear_json_prints_removed_and_the_namespace_id(daemon, tmp_path, capsys):
    srv, store = daemon
    with KVStoreClient(srv.url, auth_token=TOKEN, same_host=False) as c:
        assert c.put_chunks(NS, KEYS[:3], [chunk(i) for i in range(3)]) == 3
    ns_file = tmp_path / "ns.json"
    ns_file.write_text(json.dumps(NS.to_dict()))
    capsys.readouterr()
    rc = cli.main(["clear", srv.url, "--auth-token", TOKEN, "--namespace", f"@{ns_file}",
                   "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out) == {"removed": 3, "cleared": "namespace",
                                                   "ns_id": NS.ns_id.hex()}
    assert store.exists(NS, KEYS[:3]) == [False] * 3
    assert cli.main(["clear", srv.url, "--auth-token", TOKEN, "--all", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"removed": 0, "cleared": "all",
                                                   "ns_id": None}


@pytest.mark.parametrize("argv, cmd, extra", [
    (["clear", "http://127.0.0.1:1", "--all", "--bogus"], "clear", "--bogus"),
    (["stats", "http://127.0.0.1:1", "--namespace", "x"], "stats", "--namespace x"),
    (["inspect", "/nonexistent", "--all"], "inspect", "--all"),
])
def test_an_unknown_flag_is_reported_with_its_subcommands_usage_exit_2(argv, cmd, extra, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith(f"usage: kvstore {cmd} [-h]"), err
    assert err.endswith(f"kvstore {cmd}: error: unrecognized arguments: {extra}\n"), err


def test_an_unknown_flag_before_the_subcommand_is_the_top_parsers(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--json", "stats", "http://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("usage: kvstore [-h]") and \
        err.endswith("kvstore: error: unrecognized arguments: --json\n"), err


@pytest.mark.parametrize("cmd", ["stats", "clear"])
def test_a_401_without_a_token_exits_1_naming_the_flag_and_the_variable(cmd, daemon, capsys,
                                                                         no_env_token):
    srv, _ = daemon
    rc = cli.main([cmd, srv.url] + (["--all"] if cmd == "clear" else []))
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith(f"kvstore {cmd}: kvstore server error 401: ") and \
        "pass --auth-token TOKEN or set $KVSTORE_AUTH_TOKEN" in err, err
    rc = cli.main([cmd, srv.url, "--auth-token", "wrong"] + (["--all"] if cmd == "clear"
                                                              else []))
    err = capsys.readouterr().err
    assert rc == 1 and "the token given (--auth-token, else $KVSTORE_AUTH_TOKEN) is not the " \
        "daemon's" in err, err


def test_the_token_variable_is_used_when_no_flag_is_given(daemon, capsys, monkeypatch):
    srv, _ = daemon
    monkeypatch.setenv("KVSTORE_AUTH_TOKEN", TOKEN)
    assert cli.main(["stats", srv.url, "--json"]) == 0
    assert "tiers" in json.loads(capsys.readouterr().out)


def test_unreachable_is_1_and_a_malformed_url_is_2(capsys, no_env_token):
    url = f"http://127.0.0.1:{_free_port()}"
    assert cli.main(["stats", url, "--timeout-s", "2"]) == 1
    assert "is the kvstore daemon running?" in capsys.readouterr().err
    assert cli.main(["stats", url + "/v1", "--timeout-s", "2"]) == 2
    assert "malformed kvstore URL" in capsys.readouterr().err


class _Html(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        body = b"<html>a web page</html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_url_that_is_not_a_kvstore_daemon_is_1(capsys):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Html)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        rc = cli.main(["stats", f"http://127.0.0.1:{srv.server_address[1]}"])
    finally:
        srv.shutdown()
        srv.server_close()
    assert rc == 1
    assert "is not a kvstore daemon" in capsys.readouterr().err
