"""``kvstore stats`` and ``kvstore clear`` (``--namespace`` too) start without torch (they
answered only after its 2-3 s import), and a daemon URL whose host name does not resolve fails
at once, naming the host (it was retried until the deadline)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.daemon import cli
from kvstore.daemon.client import KVStoreClient, StoreUnavailable
from tests.kvstore.daemon.server_helpers import KEYS, NS, chunk, token_daemon

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "light-cli-token-0123"
#: a name that never resolves (RFC 2606 reserves .invalid)
NO_HOST = "http://no-such-host.invalid:8500"

#: run in a fresh interpreter: the commands' real code path against the daemon at argv[1]
_SCRIPT = """
import contextlib, io, json, sys
from kvstore.daemon import cli
url, token = sys.argv[1], sys.argv[2]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rcs = [cli.main(["stats", url, "--auth-token", token, "--json"]),
           cli.main(["stats", url, "--auth-token", token]),
           cli.main(["clear", url, "--auth-token", token, "--namespace", sys.argv[4]]),
           cli.main(["clear", url, "--auth-token", token, "--namespace-id", sys.argv[3]]),
           cli.main(["clear", url, "--auth-token", token, "--all"])]
print(json.dumps({"rcs": rcs, "out": out.getvalue(),
                  "heavy": sorted(m for m in ("torch", "numpy", "kvstore.keys") if m in sys.modules)}))
"""


@pytest.fixture()
def daemon():
    with token_daemon(TOKEN) as pair:
        yield pair


def test_stats_and_clear_run_against_a_daemon_without_importing_torch(daemon):
    srv, store = daemon
    with KVStoreClient(srv.url, auth_token=TOKEN, same_host=False) as c:
        assert c.put_chunks(NS, KEYS[:3], [chunk(i) for i in range(3)]) == 3
    # --namespace as a person writes it: a dtype alias, the optional fields left out
    hand = {"model_id": NS.model_id, "layout": {**NS.layout.to_dict(), "dtype": "fp16"}}
    p = subprocess.run([sys.executable, "-c", _SCRIPT, srv.url, TOKEN, NS.ns_id.hex(),
                        json.dumps(hand)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.splitlines()[-1])
    assert got["rcs"] == [0, 0, 0, 0, 0] and got["heavy"] == [], got
    st = json.loads(got["out"][:got["out"].index("\n}\n") + 2])  # --json, then the table
    assert st["tiers"]["cpu"]["num_chunks"] == 3
    assert st["namespaces"] == [{"ns_id": NS.ns_id.hex(), "num_chunks": 3,
                                 "namespace": NS.to_dict()}]
    assert "tiers.cpu.num_chunks" in got["out"] and "namespaces[0].namespace.model_id" \
        in got["out"]
    assert got["out"].endswith("removed 3 chunks\nremoved 0 chunks\n"
                               "removed 0 chunks (all namespaces)\n")   # --namespace cleared
    assert store.exists(NS, KEYS[:3]) == [False] * 3


def test_serve_flags_still_list_and_check_the_codecs(capsys):
    from kvstore.config import DISK_CODECS
    args = cli.build_parser().parse_args(["serve", "--disk-codec", "kivi",
                                          "--remote-codec", "lz4"])
    assert (args.disk_codec, args.remote_codec) == ("kivi", "lz4")
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["serve", "--disk-codec", "zstd"])
    assert e.value.code == 2
    assert "invalid choice: 'zstd' (choose from " + ", ".join(map(repr, DISK_CODECS)) \
        in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    text = "".join(capsys.readouterr().out.split())  # (help wraps at "shuffle-|lz4")
    assert "valuecodecofthedisktier:" + ",".join(DISK_CODECS) in text


@pytest.mark.parametrize("cmd", ["stats", "clear"])
def test_a_host_that_does_not_resolve_fails_at_once_naming_it(cmd, capsys):
    t0 = time.monotonic()
    extra = ["--all"] if cmd == "clear" else []
    assert cli.main([cmd, NO_HOST, "--timeout-s", "30", *extra]) == 1
    assert time.monotonic() - t0 < 5.0  # not the 30 s deadline
    err = capsys.readouterr().err
    route = "GET /v1/stats" if cmd == "stats" else "POST /v1/clear"
    method, path = route.split()
    assert err == (f"kvstore {cmd}: {method} {NO_HOST}{path}: cannot resolve host "
                   f"'no-such-host.invalid': Name or service not known (2 tries); check the "
                   f"host name in the URL\n")


def test_the_client_fails_fast_on_dns_unless_told_to_ride_out_restarts():
    with KVStoreClient(NO_HOST, timeout_s=30) as c:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="cannot resolve host 'no-such-host.invalid'"):
            c.exists(NS, KEYS[:1])
        assert time.monotonic() - t0 < 5.0
    # refused_tries=None (ride out a restart, as a refused connection): until the deadline
    with KVStoreClient(NO_HOST, timeout_s=1.0, refused_tries=None, same_host=False) as c:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="no answer within 1.0 s .*no-such-host"):
            c.exists(NS, KEYS[:1])
        assert 0.9 < time.monotonic() - t0 < 5.0


@pytest.mark.parametrize("cmd", [["stats"], ["clear", "--all"]])
def test_a_unix_url_is_refused_naming_the_http_form(cmd, capsys):
    url = "unix:///run/kvstore.sock"  # the same-host path (KVStoreClient's): needs torch
    assert cli.main([cmd[0], url, *cmd[1:]]) == 2
    assert capsys.readouterr().err == (
        f"kvstore {cmd[0]}: malformed kvstore URL {url!r}: expected http://HOST:PORT: a unix:// "
        f"URL is the daemon's same-host path, which only KVStoreClient takes; give the "
        f"daemon's http:// URL here\n")
