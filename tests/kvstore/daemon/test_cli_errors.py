"""``kvstore`` commands at faults a new user met: one clear line and an exit status, no
traceback (Ctrl-C while a daemon hangs, a bad ``--namespace``, a timeout that is not positive,
``serve`` with no tier)."""
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.daemon import cli
from kvstore.daemon import config as serve_config
from tests.kvstore.daemon.server_helpers import NS

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("cmd", ["stats", "clear"])
def test_ctrl_c_while_a_daemon_hangs_is_one_line_exit_130(cmd):
    # a server that accepts and never answers (as a SIGSTOPped daemon): Ctrl-C gave a
    # KeyboardInterrupt traceback from the client's wait
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        hung.settimeout(60)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        p = subprocess.Popen([sys.executable, "-m", "kvstore", cmd, url, "--timeout-s", "60"]
                             + (["--all"] if cmd == "clear" else []),
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             # as from a terminal: a background job of a script (CI) starts
                             # with SIGINT ignored, and Python keeps it so
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        conn, _ = hung.accept()  # the client sent its request and waits for the answer
        with conn:
            time.sleep(0.2)
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=30)
    assert (p.returncode, out, err) == (cli.EXIT_INTERRUPTED, "", f"kvstore {cmd}: interrupted\n")


def test_a_bad_namespace_flag_names_the_file_or_the_missing_field(tmp_path, capsys):
    url = "http://127.0.0.1:1"  # never reached: the flag is refused first
    missing = tmp_path / "missing.json"
    assert cli.main(["clear", url, "--namespace", f"@{missing}"]) == 2
    assert capsys.readouterr().err == (f"kvstore clear: error: --namespace: cannot read "
                                       f"{missing}: [Errno 2] No such file or directory: "
                                       f"'{missing}'\n")
    for text, want in [('{"model_id": "m"}', 'namespace needs "layout"'),
                       ('{"layout": {}}', 'namespace needs "model_id"'),
                       ('{"model_id": "m", "layout": {"num_layers": 2}}',
                        'namespace "layout" needs "num_kv_heads"'),
                       ("[1]", "expected a JSON object (Namespace.to_dict()), got list"),
                       ("{", "not JSON: Expecting property name enclosed in double quotes")]:
        assert cli.main(["clear", url, "--namespace", text]) == 2, text
        assert capsys.readouterr().err.startswith(f"kvstore clear: error: --namespace: {want}")
    ns_file = tmp_path / "ns.json"
    ns_file.write_text(json.dumps(NS.to_dict()))
    from kvstore.daemon.cli_client import read_namespace
    assert read_namespace(f"@{ns_file}") == NS.to_dict()


@pytest.mark.parametrize("cmd", ["stats", "clear"])
def test_a_timeout_that_is_not_positive_is_refused_as_a_usage_error(cmd, capsys):
    for value in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit) as e:
            cli.main([cmd, "http://127.0.0.1:1", "--timeout-s", value])
        assert e.value.code == 2, value
        assert f"kvstore {cmd}: error: argument --timeout-s: " in capsys.readouterr().err
    assert cli.build_parser().parse_args([cmd, "u", "--timeout-s", "0.5"]).timeout_s == 0.5


def test_serve_without_any_tier_names_the_flags(tmp_path, capsys):
    assert cli.main(["serve", "--port", "0", "--cpu-bytes", "0"]) == 2
    assert capsys.readouterr().err == (
        "kvstore serve: no tier to store chunks in: give --cpu-bytes or --gpu-bytes a size > 0, "
        "or a disk tier with --disk-path (and --disk-bytes)\n")
    cfg = serve_config.resolve({"cpu_bytes": "0", "disk_path": str(tmp_path / "d")}, {})
    assert (cfg.cpu_bytes, cfg.disk_bytes > 0) == (0, True)  # a disk tier alone is a tier


def test_clear_without_naming_what_is_a_usage_error_and_sends_nothing(capsys):
    """A bare ``kvstore clear URL`` emptied every namespace (with Redis, fleet-wide)."""
    assert cli.main(["clear", "http://127.0.0.1:1"]) == 2  # port 1: a call would fail with 1
    err = capsys.readouterr().err
    assert "kvstore clear: error: name what to clear: --namespace NS, --namespace-id HEX, or " \
           "--all" in err
    with pytest.raises(SystemExit) as e:
        cli.main(["clear", "http://127.0.0.1:1", "--all", "--namespace-id", "0" * 32])
    assert e.value.code == 2


def test_clear_refuses_an_unknown_namespace_field_as_the_daemon_does_and_sends_nothing(capsys):
    """``wire_namespace`` ignores fields a namespace does not have, so ``cache_slat`` (a typo)
    cleared the namespace without a salt; the daemon answers such a namespace with 400."""
    from kvstore.daemon.fields import NAMESPACE_FIELDS
    from kvstore.ns_wire import NAMESPACE_FIELDS as CLI_FIELDS
    assert set(CLI_FIELDS) == set(NAMESPACE_FIELDS)
    allowed = ", ".join(sorted(NAMESPACE_FIELDS))
    with socket.socket() as daemon:   # listening, so a request would be accepted here
        daemon.bind(("127.0.0.1", 0))
        daemon.listen()
        daemon.setblocking(False)
        url = f"http://127.0.0.1:{daemon.getsockname()[1]}"
        typo = json.dumps({**NS.to_dict(), "cache_slat": "tenant-a"})
        assert cli.main(["clear", url, "--namespace", typo]) == 2
        assert capsys.readouterr().err == (f"kvstore clear: error: --namespace: unknown "
                                           f"namespace field 'cache_slat'; a namespace has "
                                           f"{allowed}\n")
        two = json.dumps({**NS.to_dict(), "salt": "a", "modle_id": "m"})
        assert cli.main(["clear", url, "--namespace", two]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvstore clear: error: --namespace: unknown namespace fields "
                              "'salt', 'modle_id'; a namespace has ") and err.count("\n") == 1
        with pytest.raises(BlockingIOError):   # no connection was made
            daemon.accept()


def test_clear_refuses_an_unknown_layout_field_naming_it_and_sends_nothing(capsys):
    """``hed_dim`` instead of ``head_dim`` was reported as a missing ``head_dim``, and beside
    it was ignored; the daemon answers either with 400 naming it."""
    layout = NS.layout.to_dict()
    with socket.socket() as daemon:   # listening, so a request would be accepted here
        daemon.bind(("127.0.0.1", 0))
        daemon.listen()
        daemon.setblocking(False)
        url = f"http://127.0.0.1:{daemon.getsockname()[1]}"
        beside = json.dumps({**NS.to_dict(), "layout": {**layout, "hed_dim": 8}})
        assert cli.main(["clear", url, "--namespace", beside]) == 2
        assert capsys.readouterr().err == (
            "kvstore clear: error: --namespace: unknown namespace layout field 'hed_dim'; a "
            "layout has chunk_size, dtype, head_dim, num_kv_heads, num_layers\n")
        del layout["head_dim"]
        instead = json.dumps({**NS.to_dict(), "layout": {**layout, "hed_dim": 8}})
        assert cli.main(["clear", url, "--namespace", instead]) == 2
        assert "unknown namespace layout field 'hed_dim'" in capsys.readouterr().err
        with pytest.raises(BlockingIOError):   # no connection was made
            daemon.accept()
