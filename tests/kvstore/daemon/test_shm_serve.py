"""``kvstore serve --unix-socket PATH`` as a process: the setting (flag, env, file; ``unix://``
form; too long a path refused), the startup lines, a same-host client served by the daemon
whose ``/v1/stats`` names the socket and the instance, and the socket file gone after SIGTERM.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from kvstore.daemon import config as serve_config
from tests.kvstore.daemon.shm_helpers import KEYS, RawClient, as_bytes, chunk

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "serve-token-0123456789"


def test_unix_socket_setting_is_normalised_and_makes_the_cpu_tier_shared(tmp_path):
    cfg = serve_config.resolve({"unix_socket": f"unix://{tmp_path}/kv.sock"}, env={})
    assert cfg.unix_socket == f"{tmp_path}/kv.sock"
    assert cfg.store_config_kwargs()["cpu_shared"] is True
    cfg = serve_config.resolve({}, env={"KVSTORE_UNIX_SOCKET": "rel.sock"})
    assert cfg.unix_socket == os.path.abspath("rel.sock")
    cfg = serve_config.resolve({}, env={})
    assert cfg.unix_socket is None and cfg.store_config_kwargs()["cpu_shared"] is False
    cfg = serve_config.resolve({"unix_socket": "/tmp/x.sock", "cpu_bytes": "0",
                                "disk_bytes": "1MiB", "disk_path": str(tmp_path)}, env={})
    assert cfg.store_config_kwargs()["cpu_shared"] is False  # no CPU tier: nothing to share
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        serve_config.resolve({"unix_socket": "/tmp/" + "x" * 120}, env={})
    # unix://tmp/kv.sock was read as the relative path tmp/kv.sock, which clients refuse
    with pytest.raises(ValueError, match="a URL takes an absolute path, unix:///ABSOLUTE/PATH"):
        serve_config.resolve({"unix_socket": "unix://tmp/kv.sock"}, env={})


def _readline(proc, timeout: float) -> str:
    out = []
    t = threading.Thread(target=lambda: out.append(proc.stdout.readline().decode()))
    t.start()
    t.join(timeout)
    return out[0] if out else ""


def test_serve_with_a_unix_socket_serves_same_host_clients(tmp_path):
    path = str(tmp_path / "kv.sock")
    log = open(tmp_path / "serve.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--port", "0", "--auth-token", TOKEN,
         "--cpu-bytes", "64KiB", "--page-bytes", "256", "--unix-socket", f"unix://{path}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=log, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        first = _readline(proc, 60)
        assert "listening on http://" in first, (tmp_path / "serve.log").read_text()[-2000:]
        url = first.strip().rsplit(" ", 1)[-1]
        assert _readline(proc, 10).strip() == f"kvstore serve: same-host path on unix://{path}"
        req = urllib.request.Request(f"{url}/v1/stats",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            stats = json.loads(r.read())
        assert stats["unix_socket"] == path
        c = RawClient(path)
        hello = c.hello(TOKEN)
        assert hello["instance"] == stats["instance"] and hello["arena_bytes"] == 64 << 10
        kvs = [chunk(1), chunk(2)]
        assert c.put(KEYS[:2], kvs)["stored"] == 2
        reply, got = c.get(KEYS[:2])
        assert got == [as_bytes(kv) for kv in kvs] and reply["payload_bytes"] == 0
        c.release(reply["borrow"])
        c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not os.path.exists(path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
