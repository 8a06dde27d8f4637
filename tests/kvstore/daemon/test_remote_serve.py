"""``kvstore serve`` with a remote tier: its settings through flags, ``KVSTORE_*`` variables and
the config file; a refused password as a one-line startup error that never shows the password;
real daemons (``python -m kvstore serve``) writing behind to a real Redis, with their stats
and metrics."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from kvstore.codec import unpack_value
from kvstore.config import StoreConfig
from kvstore.daemon import config as C
from kvstore.daemon.cli import build_parser, main
from kvstore.daemon.client import KVStoreClient
from bench.redis_servers import RedisServer
from tests.kvstore.daemon.hostile_helpers import ROOT
from tests.kvstore.remote_helpers import LAY, NS, prompt, rkey
from tests.redis_fixtures import require_redis

PASSWORD = "pw-9f3a7c-not-for-logs"


def _flags(*argv: str) -> dict:
    args = build_parser().parse_args(["serve", *argv])
    return {k: v for k, v in vars(args).items() if k in C.FIELDS}


# ---- settings ---------------------------------------------------------------------------------
def test_remote_flags_parse_into_the_store_config():
    cfg = C.resolve(_flags("--remote-url", "redis://10.0.0.1:7000,10.0.0.2:7000",
                           "--remote-key-prefix", "prod-a", "--remote-ttl-s", "3600",
                           "--remote-timeout-s", "0.5", "--remote-queue-bytes", "64MiB",
                           "--remote-restart-check-s", "0"),
                    env={})
    kw = cfg.store_config_kwargs()
    assert {k: v for k, v in kw.items() if k.startswith("remote_")} == {
        "remote_url": "redis://10.0.0.1:7000,10.0.0.2:7000", "remote_key_prefix": "prod-a",
        "remote_ttl_s": 3600.0, "remote_timeout_s": 0.5, "remote_queue_bytes": 64 << 20,
        "remote_codec": "raw", "remote_password": None, "remote_restart_check_s": 0.0}
    sc = StoreConfig(**kw)  # the store accepts them as they are
    assert (sc.remote_url, sc.remote_key_prefix, sc.remote_queue_bytes,
            sc.remote_restart_check_s) == ("redis://10.0.0.1:7000,10.0.0.2:7000", "prod-a",
                                           64 << 20, 0.0)
    # the default, and from the environment; a negative interval is refused
    assert C.resolve(_flags("--remote-url", "redis://h:1"), env={}).remote_restart_check_s == 10
    assert C.resolve(_flags("--remote-url", "redis://h:1"),
                     env={"KVSTORE_REMOTE_RESTART_CHECK_S": "2.5"}).remote_restart_check_s == 2.5
    with pytest.raises(ValueError, match="remote_restart_check_s >= 0"):
        C.resolve(_flags("--remote-url", "redis://h:1", "--remote-restart-check-s", "-1"),
                  env={})


def test_no_remote_url_means_no_remote_fields_for_the_store():
    cfg = C.resolve(_flags(), env={})
    assert cfg.remote_url is None
    assert not any(k.startswith("remote_") for k in cfg.store_config_kwargs())
    assert StoreConfig(**cfg.store_config_kwargs()).remote_url is None
    # an empty variable is unset, not a URL
    assert C.resolve({}, env={"KVSTORE_REMOTE_URL": ""}).remote_url is None


def test_flags_beat_env_which_beats_the_config_file(tmp_path):
    path = tmp_path / "kvstore.toml"
    path.write_text('[serve]\nremote_url = "redis://file-host:6379"\nremote-key-prefix = "file"\n'
                    'remote_ttl_s = 60\nremote_timeout_s = 1.5\nremote_queue_bytes = "1MiB"\n'
                    f'remote_password = "from-file"\n')
    from_file = C.resolve({}, env={}, config_file=str(path))
    assert (from_file.remote_url, from_file.remote_key_prefix, from_file.remote_ttl_s,
            from_file.remote_timeout_s, from_file.remote_queue_bytes,
            from_file.remote_password) == ("redis://file-host:6379", "file", 60.0, 1.5,
                                           1 << 20, "from-file")
    env = {"KVSTORE_REMOTE_URL": "redis://env-host:6379", "KVSTORE_REMOTE_TTL_S": "120",
           "KVSTORE_REMOTE_PASSWORD": "from-env", "KVSTORE_CONFIG": str(path)}
    from_env = C.resolve({}, env=env)
    assert (from_env.remote_url, from_env.remote_key_prefix, from_env.remote_ttl_s,
            from_env.remote_password) == ("redis://env-host:6379", "file", 120.0, "from-env")
    cfg = C.resolve(_flags("--remote-url", "redis://flag-host:6379", "--remote-ttl-s", "5",
                           "--remote-queue-bytes", "2MiB"), env=env)
    assert (cfg.remote_url, cfg.remote_key_prefix, cfg.remote_ttl_s, cfg.remote_timeout_s,
            cfg.remote_queue_bytes, cfg.remote_password) == (
        "redis://flag-host:6379", "file", 5.0, 1.5, 2 << 20, "from-env")
    assert cfg.store_config_kwargs()["remote_password"] == "from-env"


def test_a_password_is_never_in_repr_and_a_url_password_moves_out_of_the_url():
    cfg = C.resolve({"remote_url": f"redis://app:{PASSWORD}@h:7000"}, env={})
    assert cfg.remote_url == "redis://app@h:7000"
    assert cfg.remote_password == PASSWORD
    assert PASSWORD not in repr(cfg) and PASSWORD not in str(cfg)
    assert PASSWORD not in repr(StoreConfig(**cfg.store_config_kwargs()))
    # a password given apart wins over none in the URL, and stays out of repr too
    cfg = C.resolve({}, env={"KVSTORE_REMOTE_URL": "redis://h:7000",
                             "KVSTORE_REMOTE_PASSWORD": PASSWORD})
    assert cfg.remote_password == PASSWORD and PASSWORD not in repr(cfg)


@pytest.mark.parametrize("fields, words", [
    ({"remote_url": f"http://:{PASSWORD}@h:1"}, "redis:// or rediss://"),
    ({"remote_url": f"redis://:{PASSWORD}@h:notaport"}, "port must be a number"),
    ({"remote_url": "redis://h:1", "remote_ttl_s": -1}, "remote_ttl_s must be >= 0"),
    ({"remote_url": "redis://h:1", "remote_timeout_s": 0}, "remote_timeout_s"),
    ({"remote_url": "redis://h:1", "remote_timeout_s": "nan"}, "remote_timeout_s"),
    ({"remote_url": "redis://h:1", "remote_queue_bytes": 0}, "remote_queue_bytes must be > 0"),
    ({"remote_url": "redis://h:1", "remote_queue_bytes": "lots"}, "lots"),
])
def test_bad_remote_settings_are_refused_before_any_tier_is_built(fields, words):
    with pytest.raises(ValueError, match=words) as e:
        C.resolve(fields, env={})
    assert PASSWORD not in str(e.value)


def test_bad_remote_url_flag_exits_2_with_the_reason_and_no_password(capsys):
    assert main(["serve", "--remote-url", f"redis://:{PASSWORD}@h:bad"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstore serve: remote URL port must be a number")
    assert PASSWORD not in err


# ---- a refused password at startup -------------------------------------------------------------
def _serve_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "kvstore", "serve", "--port", "0", "--cpu-bytes", "1MiB",
            "--page-bytes", str(LAY.chunk_bytes), *flags]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


@pytest.fixture
def redis_with_password(tmp_path):
    """A standalone Redis that requires ``PASSWORD``."""
    require_redis()
    with RedisServer(tmp_path / "redis", password=PASSWORD) as srv:
        yield srv


@pytest.mark.parametrize("how", ["env", "url", "none"])
def test_wrong_password_exits_nonzero_within_seconds_naming_auth(redis_with_password, how):
    url = f"redis://127.0.0.1:{redis_with_password.port}"
    wrong = "wrong-" + PASSWORD[::-1]
    env = _env()
    if how == "env":
        env["KVSTORE_REMOTE_PASSWORD"] = wrong
    elif how == "url":
        url = f"redis://:{wrong}@127.0.0.1:{redis_with_password.port}"
    t0 = time.monotonic()
    proc = subprocess.run(_serve_cmd("--remote-url", url), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=30)
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert took < 20, took   # the process's start alone takes seconds on a loaded host
    assert "listening" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("kvstore serve: cannot start the remote tier: Redis at "
                                f"127.0.0.1:{redis_with_password.port}"), out
    assert "AUTH failed" in lines[-1], out
    if how == "none":
        assert "needs a password" in lines[-1], out
    else:
        assert "refused the credentials" in lines[-1], out
    assert "Traceback" not in out
    assert wrong not in out and PASSWORD not in out


# ---- real daemons over a real Redis ----------------------------------------------------------
class Daemon:
    """``python -m kvstore serve`` on a free port; its stderr (the log) kept in a file."""

    def __init__(self, tmp_path, name: str, *flags: str, **env: str):
        self.log_path = tmp_path / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(_serve_cmd("--log-level", "debug", *flags), cwd=ROOT,
                                         env=_env(**env), stdout=subprocess.PIPE, stderr=log)
        line = self.proc.stdout.readline().decode()
        assert "listening on" in line, self.log_path.read_text()
        self.url = line.strip().rsplit(" ", 1)[1]
        self.client = KVStoreClient(self.url, timeout_s=10.0)

    def stop(self) -> str:
        """Stop it (SIGTERM: the write-behind queue is flushed) and return its log."""
        self.client.close()
        self.proc.terminate()
        out = self.proc.stdout.read().decode()
        assert self.proc.wait(30) == 0, self.log_path.read_text()
        return out + self.log_path.read_text()


def _wait_keys(r, pattern: bytes, n: int, timeout_s: float = 10.0) -> list[bytes]:
    deadline = time.monotonic() + timeout_s
    while True:
        keys = sorted(r.keys(pattern))
        if len(keys) >= n or time.monotonic() > deadline:
            return keys
        time.sleep(0.02)


def _chunk_of(value: bytes, key) -> torch.Tensor:
    h, raw = unpack_value(value, bytes(key))
    assert (h.dtype, tuple(h.shape)) == ("float16", LAY.shape())
    return torch.from_numpy(np.array(raw)).view(torch.float16).view(LAY.shape())


def test_daemons_write_behind_to_redis_under_their_key_prefix(tmp_path, redis_with_password):
    port = redis_with_password.port
    # one daemon configured wholly by env (default prefix), one by flags (its own prefix)
    a = Daemon(tmp_path, "a", KVSTORE_REMOTE_URL=f"redis://127.0.0.1:{port}",
               KVSTORE_REMOTE_PASSWORD=PASSWORD)
    b = Daemon(tmp_path, "b", "--remote-url", f"redis://127.0.0.1:{port}",
               "--remote-key-prefix", "team-b", "--remote-ttl-s", "600",
               KVSTORE_REMOTE_PASSWORD=PASSWORD)
    try:
        keys, kvs = prompt(NS, 0, 3)
        assert a.client.put_chunks(NS, keys, kvs) == 3
        assert b.client.put_chunks(NS, keys[:2], kvs[:2]) == 2
        with redis_with_password.client() as r:
            got_a = _wait_keys(r, b"kvstore:*", 3)
            got_b = _wait_keys(r, b"team-b:*", 2)
            assert got_a == sorted(rkey(k) for k in keys)
            assert got_b == sorted(rkey(k, "team-b") for k in keys[:2])
            assert len(r.keys(b"*")) == 5
            for k, kv in zip(keys, kvs):
                assert torch.equal(_chunk_of(r.get(rkey(k)), k), kv)
            assert r.ttl(rkey(keys[0])) == -1  # no expiry by default
            assert 590 <= r.ttl(rkey(keys[0], "team-b")) <= 600

        st = a.client.stats()["remote"]
        assert (st["url"], st["cluster"], st["key_prefix"], st["ttl_s"], st["timeout_s"],
                st["queue_capacity_bytes"]) == (f"redis://:***@127.0.0.1:{port}", False, "kvstore",
                                                0.0, 0.25, 256 << 20)
        assert st["writes"] == 3
        assert b.client.stats()["remote"]["key_prefix"] == "team-b"
        metrics = a.client.metrics_text()
        assert "kvstore_remote_writes_total 3.0" in metrics.splitlines()
        assert "kvstore_remote_writes_total 2.0" in b.client.metrics_text().splitlines()

        # kvstore stats shows the remote section as rows of the table
        table = subprocess.run([sys.executable, "-m", "kvstore", "stats", a.url], cwd=ROOT,
                               env=_env(), capture_output=True, text=True, timeout=30)
        assert table.returncode == 0, table.stderr
        rows = dict((line.split(None, 1) + [""])[:2] for line in table.stdout.splitlines())
        assert rows["remote.key_prefix"] == "kvstore"
        assert rows["remote.url"] == f"redis://:***@127.0.0.1:{port}"
        assert rows["remote.writes"] == "3"
        shown = json.dumps(a.client.stats()) + metrics + table.stdout
        assert PASSWORD not in shown
    finally:
        logs = a.stop() + b.stop()
    assert "remote tier: Redis redis://:***@127.0.0.1:%d, key prefix 'team-b'" % port in logs
    assert PASSWORD not in logs
