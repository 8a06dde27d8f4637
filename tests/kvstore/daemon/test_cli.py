"""``kvstore`` CLI and ``kvstore serve`` as a real process: config precedence, bind safety,
stats/clear/inspect, SIGTERM drain, SIGKILL + restart durability, clients of a dead server."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvstore.daemon import cli

from kvstore.daemon import config as serve_config
from kvstore.daemon import protocol as P
from kvstore.daemon.client import KVStoreClient, StoreUnavailable
from tests.kvstore.daemon.server_helpers import NS, chunk

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "cli-token"
KEYS = NS.chunk_keys(list(range(4 * 40)))  # 40 chained keys, 256-byte chunks


# ---- configuration -------------------------------------------------------------------------
def test_flags_beat_env_beat_file(tmp_path):
    yml = tmp_path / "kv.yaml"
    yml.write_text("serve:\n  port: 1111\n  cpu-bytes: 2GiB\n  policy: lfu\n  max_batch_keys: 7\n")
    env = {"KVSTORE_PORT": "2222", "KVSTORE_CPU_BYTES": "3MiB"}
    cfg = serve_config.resolve({"port": 3333, "cpu_bytes": None}, env, str(yml))
    assert (cfg.port, cfg.cpu_bytes, cfg.policy, cfg.max_batch_keys) == (3333, 3 << 20, "lfu", 7)
    cfg = serve_config.resolve({}, {**env, "KVSTORE_CONFIG": str(yml)})
    assert (cfg.port, cfg.cpu_bytes) == (2222, 3 << 20)
    toml = tmp_path / "kv.toml"
    toml.write_text('port = 4444\ndisk_path = "/tmp/x"\ndisk_bytes = "1GB"\n')
    cfg = serve_config.resolve({}, {}, str(toml))
    assert (cfg.port, cfg.disk_path, cfg.disk_bytes, cfg.host) == (4444, "/tmp/x", 10**9,
                                                                  "127.0.0.1")
    assert cfg.store_config_kwargs()["disk_policy"] == "lru"
    toml.write_text("prot = 1\n")
    with pytest.raises(ValueError, match=r"unknown settings \['prot'\]"):
        serve_config.resolve({}, {}, str(toml))


def test_http_parser_setting_is_checked():
    assert serve_config.resolve({}, {}).http_parser == "python"
    assert serve_config.resolve({}, {"KVSTORE_HTTP_PARSER": "c"}).http_parser == "c"
    with pytest.raises(ValueError, match="http_parser must be 'python' or 'c'"):
        serve_config.resolve({"http_parser": "rust"}, {})


def test_max_inflight_bytes_auto_default_flag_and_env():
    assert serve_config.resolve({}, {}).max_inflight_bytes == 64 << 20  # 1GiB cpu / 16
    assert serve_config.resolve({"cpu_bytes": "128MiB"}, {}).max_inflight_bytes == 32 << 20
    args = cli.build_parser().parse_args(["serve", "--max-inflight-bytes", "48MiB"])
    flags = {k: v for k, v in vars(args).items() if k in serve_config.FIELDS}
    assert serve_config.resolve(flags, {}).max_inflight_bytes == 48 << 20
    env = {"KVSTORE_MAX_INFLIGHT_BYTES": "0"}
    assert serve_config.resolve({}, env).max_inflight_bytes == 0
    with pytest.raises(ValueError):
        serve_config.resolve({"max_inflight_bytes": "lots"}, {})


def test_non_loopback_bind_needs_a_token_or_insecure(capsys):
    assert serve_config.is_loopback("127.0.0.1") and serve_config.is_loopback("::1")
    assert not serve_config.is_loopback("0.0.0.0")
    assert cli.main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "refusing to bind non-loopback address '0.0.0.0' without --auth-token" \
        in capsys.readouterr().err
    assert serve_config.resolve({"host": "0.0.0.0", "insecure": True}, {}).insecure is True
    assert serve_config.resolve({"host": "10.0.0.1", "auth_token": "t"}, {}).auth_token == "t"
    assert cli.main(["serve", "--cpu-bytes", "12 parsecs"]) == 2


def test_a_malformed_url_is_named_as_such_exit_2(capsys):
    for url in ("notaurl", "127.0.0.1:8500", "ftp://h:1", "http://:8500", "http://h:99999"):
        assert cli.main(["stats", url]) == 2, url
        err = capsys.readouterr().err
        assert err.startswith(f"kvstore stats: malformed kvstore URL {url!r}: expected "
                              "http://HOST:PORT"), err
    assert cli.main(["clear", "notaurl", "--all"]) == 2
    assert "malformed kvstore URL 'notaurl'" in capsys.readouterr().err


def test_inspect_into_a_closed_pipe_exits_quietly(tmp_path):
    import lmdb
    lmdb.open(str(tmp_path / "disk")).close()
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first write, as `| head` after its lines
    try:
        p = subprocess.run([sys.executable, "-m", "kvstore", "inspect", str(tmp_path / "disk")],
                           cwd=ROOT, stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (cli.EXIT_BROKEN_PIPE, "")


def test_unknown_policy_names_the_flag_and_the_valid_names(capsys):
    assert cli.main(["serve", "--port", "0", "--policy", "foo"]) == 2
    err = capsys.readouterr().err
    assert "unknown --policy 'foo'" in err and "gpu_policy" not in err
    assert "choose one of arc, fifo, lfu, lru, s3fifo" in err
    assert serve_config.resolve({"policy": "s3fifo"}, {}).policy == "s3fifo"


def test_unusable_store_settings_exit_2_with_the_reason_not_a_traceback(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    small = ["serve", "--port", "0", "--cpu-bytes", "64KiB"]
    cases = [
        (["--disk-path", str(a_file / "kv"), "--disk-bytes", "1MiB"],
         f"cannot open the disk tier at '{a_file / 'kv'}'"),
        (["--disk-path", str(a_file), "--disk-bytes", "1MiB"],
         f"disk tier path '{a_file}' is a file, not a directory"),
        (["--disk-path", str(tmp_path / "kv0"), "--disk-bytes", "0"],
         "give the disk tier a capacity"),
        (["--disk-bytes", "1MiB"], "disk_bytes 1048576 without disk_path"),
        (["--config", str(tmp_path / "missing.yaml")], "cannot read config file"),
        (["--request-timeout-s", "-1"], "request_timeout_s must be a positive number"),
        (["--max-lease-s", "nan"], "max_lease_s must be a positive number"),
        (["--shutdown-timeout-s", "-2"], "shutdown_timeout_s must be >= 0"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--gpu-bytes", "1MiB"], "CUDA is not available"))
    for extra, msg in cases:
        assert cli.main(small + extra) == 2, extra
        assert msg in capsys.readouterr().err, extra
    not_lmdb = tmp_path / "not_lmdb"
    not_lmdb.mkdir()
    (not_lmdb / "data.mdb").write_bytes(b"not an lmdb file")
    assert cli.main(["inspect", str(not_lmdb)]) == 2
    assert "is not a readable disk tier" in capsys.readouterr().err
    assert (not_lmdb / "data.mdb").read_bytes() == b"not an lmdb file"  # left untouched


def test_a_disk_path_alone_gets_the_default_disk_capacity(tmp_path):
    from kvstore.defaults import DEFAULT_DISK_BYTES
    from kvstore.units import parse_size
    cfg = serve_config.resolve({"disk_path": str(tmp_path / "kv")}, {})
    assert (cfg.disk_path, cfg.disk_bytes) == (str(tmp_path / "kv"),
                                               parse_size(DEFAULT_DISK_BYTES))
    assert cfg.store_config_kwargs()["disk_bytes"] == 4 << 30
    assert serve_config.resolve({}, {}).disk_bytes == 0                   # no path: no tier


def test_format_table_shows_sizes_readably():
    text = cli.format_table({"tiers": {"cpu": {"capacity_bytes": 8 << 30, "num_chunks": 1234}},
                             "hits": 5, "ratio": 0.25})
    assert text.splitlines() == ["tiers.cpu.capacity_bytes  8,589,934,592 (8GiB)",
                                 "tiers.cpu.num_chunks      1,234",
                                 "hits                      5",
                                 "ratio                     0.25"]


def test_serve_on_a_port_in_use_exits_2_naming_it(capsys):
    # the bind error escaped as a traceback (exit 1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--port", str(port), "--cpu-bytes", "1MiB"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"kvstore serve: cannot listen on 127.0.0.1:{port}: [Errno 98] error while attempting "
        f"to bind on address ('127.0.0.1', {port}): address already in use")


def test_format_table_prints_a_pid_as_is():
    # inspect's held_by_pid was "26,690", while the refusal names "process 26690"
    assert cli.format_table({"held_by_pid": 26690, "num_chunks": 26690}).splitlines() == [
        "held_by_pid  26690", "num_chunks   26,690"]


# ---- the daemon as a process ---------------------------------------------------------------
class Daemon:
    """``python -m kvstore serve --port 0 ...`` in a subprocess; ``url`` once it listens."""

    def __init__(self, log_path: Path, *args: str):
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--port", "0", "--auth-token", TOKEN,
             "--log-level", "info", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = self._readline(60)
        assert "listening on http://" in line, log_path.read_text()[-2000:]
        self.url = line.strip().rsplit(" ", 1)[-1]
        self.port = int(self.url.rsplit(":", 1)[1])

    def _readline(self, timeout: float) -> str:
        out = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline().decode()))
        t.start()
        t.join(timeout)
        return out[0] if out else ""

    def client(self, **kw) -> KVStoreClient:
        return KVStoreClient(self.url, auth_token=TOKEN, **kw)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        self.log.close()
        return rc


def _serve_args(disk: Path, cpu_bytes: str = "64KiB") -> list[str]:
    # 64 KiB pages: one 256-byte chunk per page, so "256KiB" is a 4-chunk CPU tier
    return ["--cpu-bytes", cpu_bytes, "--disk-path", str(disk), "--disk-bytes", "64MiB",
            "--policy", "lru", "--page-bytes", "64KiB"]


def test_sigkill_then_restart_serves_every_durable_chunk_bit_exact(tmp_path):
    disk = tmp_path / "disk"
    d = Daemon(tmp_path / "log1", *_serve_args(disk))
    kvs = [chunk(i) for i in range(len(KEYS))]
    stop = threading.Event()
    with d.client(timeout_s=10) as c:
        assert c.put_chunks(NS, KEYS[:10], kvs[:10], durable=True) == 10

        def flood():  # non-durable puts that spill to disk while the kill lands
            i = 10
            with d.client(timeout_s=2) as c2:
                while not stop.is_set() and i < len(KEYS):
                    try:
                        c2.put_chunks(NS, KEYS[i:i + 5], kvs[i:i + 5])
                    except Exception:
                        return
                    i += 5
        t = threading.Thread(target=flood)
        t.start()
        time.sleep(0.3)
        assert d.stop(signal.SIGKILL) == -signal.SIGKILL
        stop.set()
        t.join()
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):  # a dead server: a timeout error, not a hang
            c.exists(NS, KEYS[:1], timeout_s=1.0)
        assert time.monotonic() - t0 < 2.0
    d2 = Daemon(tmp_path / "log2", *_serve_args(disk))
    try:
        with d2.client(timeout_s=10) as c:
            got = c.get_chunks(NS, KEYS)
            assert all(torch.equal(got[i], kvs[i]) for i in range(10))  # durable: all there
            assert all(g is None or torch.equal(g, kv) for g, kv in zip(got, kvs))  # no tears
            assert c.stats()["corruptions"] == 0
    finally:
        assert d2.stop() == 0


def _raw_put_start(port: int, body: bytes, split: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST /v1/put HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
              f"Content-Type: {P.BINARY_CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\n\r\n"
              .encode() + body[:split])
    return s


def test_sigterm_stops_accepting_finishes_in_flight_flushes_and_exits_0(tmp_path, capsys):
    disk = tmp_path / "disk"
    d = Daemon(tmp_path / "log1", *_serve_args(disk, cpu_bytes="256KiB"))  # 4 pages: 4 chunks
    kvs = [chunk(100 + i) for i in range(12)]
    with d.client() as c:
        assert c.put_chunks(NS, KEYS[:8], kvs[:8]) == 8  # 4 spill to disk (write-behind)
        assert cli.main(["stats", d.url, "--auth-token", TOKEN]) == 0
        table = capsys.readouterr().out
        assert "tiers.cpu.num_chunks" in table and "stored_chunks" in table
        assert c.stats()["server"]["http_parser"] == "python"  # the default of kvstore serve
    entries = [P.entry_for(k, kv) for k, kv in zip(KEYS[8:12], kvs[8:12])]
    body = P.put_header(NS, [e for e, _ in entries], durable=True) + \
        b"".join(bytes(v) for _, v in entries)
    s = _raw_put_start(d.port, body, len(body) // 2)  # a put in flight
    time.sleep(0.2)
    d.proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    with pytest.raises(ConnectionRefusedError):  # no longer accepting
        socket.create_connection(("127.0.0.1", d.port), timeout=1).close()
    s.sendall(body[len(body) // 2:])
    answer = s.recv(65536).decode()
    s.close()
    assert answer.startswith("HTTP/1.1 200") and '"stored": 4' in answer
    assert d.proc.wait(30) == 0  # (no second SIGTERM: that one exits at once, status 130)
    assert d.stop() == 0
    rep = cli.inspect_disk(str(disk), limit=0, verify=True)
    # KEYS[0:8] spilled from the 4-chunk CPU tier (write-behind), KEYS[8:12] written through
    # by the durable put: all 12 committed by the time the process exits
    assert (rep["num_chunks"], rep["num_bad"]) == (12, 0)
    assert rep["layouts"] == {"float16 [2, 2, 4, 1, 8]": 12}
    assert rep["namespaces"] == {NS.ns_id.hex(): 12}
    assert {c["key"] for c in rep["chunks"]} == {k.hex() for k in KEYS[:12]}
    assert cli.main(["inspect", str(disk), "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "num_chunks" in out and "chunks[0].key" in out and "chunks[1]" not in out


def test_clear_and_stats_commands_against_a_live_daemon(tmp_path, capsys):
    d = Daemon(tmp_path / "log", "--cpu-bytes", "1MiB", "--http-parser", "c")
    try:
        with d.client() as c:
            assert c.stats()["server"]["http_parser"] == "c"
            c.put_chunks(NS, KEYS[:3], [chunk(i) for i in range(3)])
        ns_json = json.dumps(NS.to_dict())
        assert cli.main(["clear", d.url, "--auth-token", TOKEN, "--namespace", ns_json]) == 0
        assert capsys.readouterr().out.strip() == "removed 3 chunks"
        assert cli.main(["clear", d.url, "--auth-token", "wrong", "--all"]) == 1
        assert "401" in capsys.readouterr().err
        assert cli.main(["stats", d.url, "--auth-token", TOKEN, "--json"]) == 0
        st = json.loads(capsys.readouterr().out)
        assert st["tiers"]["cpu"]["num_chunks"] == 0 and st["stored_chunks"] == 3
        assert cli.main(["stats", d.url, "--auth-token", TOKEN]) == 0  # the table
        table = capsys.readouterr().out
        assert any(r.split() == ["tiers.cpu.capacity_bytes", "1,048,576", "(1MiB)"]
                   for r in table.splitlines())
        assert any(r.split() == ["stored_chunks", "3"] for r in table.splitlines())
        assert cli.main(["stats", d.url, "--auth-token", "wrong"]) == 1
        assert "401" in capsys.readouterr().err
        assert cli.main(["stats", d.url]) == 1  # no token at all
        assert "401" in capsys.readouterr().err
    finally:
        assert d.stop() == 0
    t0 = time.monotonic()  # the daemon is gone: refused at once, not after the 5 s default
    assert cli.main(["stats", d.url]) == 1
    assert time.monotonic() - t0 < 1.0
    assert "connection refused (2 tries); is the kvstore daemon running?" \
        in capsys.readouterr().err


def test_a_misspelt_kvstore_variable_is_named_not_silently_ignored(caplog):
    import logging
    env = {"KVSTORE_POLCY": "lfu", "KVSTORE_POLICY": "fifo", "KVSTORE_CONFIGG": "x",
           "KVSTORE_VLLM_MODEL_DIR": "/m", "OTHER": "1"}
    assert serve_config.unknown_env(env) == [("KVSTORE_CONFIGG", None),
                                             ("KVSTORE_POLCY", "KVSTORE_POLICY")]
    with caplog.at_level(logging.WARNING, logger="kvstore.daemon.config"):
        cfg = serve_config.resolve({}, env)
    assert cfg.policy == "fifo"
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["KVSTORE_CONFIGG is not a kvstore serve setting: ignored",
                    "KVSTORE_POLCY is not a kvstore serve setting: ignored (did you mean "
                    "KVSTORE_POLICY?)"]
