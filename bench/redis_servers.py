"""Real ``redis-server`` processes on free loopback ports, for tests and benchmarks.

    with RedisServer(workdir) as srv:                    # standalone, no persistence
        srv.client().set(b"k", b"v"); srv.kill(); srv.restart()   # back on the same port, empty

A cluster of such servers: ``bench.redis_cluster.RedisClusterGroup``.

Every server runs in its own process group with its own directory (``--dir``, its log, and in
cluster mode its ``nodes.conf``) and without persistence (``--save "" --appendonly no``), so a
restarted server starts empty. Every started process is killed on ``stop()``, on leaving the
``with`` block, and at interpreter exit (the processes are tracked with ``bench.servers``').
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

from bench.servers import _LIVE, _kill_all, free_port, kill_process

INSTALL_HINT = ("install it with `apt-get install redis-server` (Debian/Ubuntu; brings redis-cli), "
                "or run `make redis` as root")

_ATEXIT_REGISTERED = False


class RedisNotInstalled(RuntimeError):
    """``redis-server`` (or ``redis-cli``) is not on ``PATH``; the message says how to install."""


def redis_binary(name: str = "redis-server") -> str:
    """Path of ``name`` (``redis-server`` or ``redis-cli``) on ``PATH``.

    Raises:
        RedisNotInstalled: not found; the message carries the install hint.
    """
    path = shutil.which(name)
    if path is None:
        raise RedisNotInstalled(f"{name} is not installed: {INSTALL_HINT}")
    return path


def _track(popen: subprocess.Popen) -> None:
    """Kill ``popen`` at interpreter exit unless it was stopped before."""
    global _ATEXIT_REGISTERED
    _LIVE.add(popen)
    if not _ATEXIT_REGISTERED:
        atexit.register(_kill_all)
        _ATEXIT_REGISTERED = True


class _PortTaken(Exception):
    """redis-server exited because its port was taken after ``free_port`` chose it."""


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class RedisServer:
    """One ``redis-server`` on 127.0.0.1. Use as ``with RedisServer(workdir) as srv:``
    (or call ``start()``); leaving the block stops it.

    Args:
        workdir: parent folder; the server gets ``workdir/redis-<port>/`` (log, cluster config).
        port: TCP port (``None``: a free one).
        password: ``requirepass`` (``None``: no auth).
        maxmemory: ``maxmemory`` in bytes (``None``: unlimited).
        maxmemory_policy: e.g. ``"noeviction"``, ``"allkeys-lru"`` (``None``: Redis's default).
        cluster: start with ``--cluster-enabled yes`` (see ``RedisClusterGroup``).
        extra_args: more ``redis-server`` arguments, appended verbatim.
        startup_timeout_s: how long ``start()`` waits for PING.
        tls: ``(cert file, key file, CA file)``: serve TLS only on ``port`` (no plain port;
            client certificates optional, checked against the CA when given); ``url`` is then
            ``rediss://...?ssl_ca_certs=<CA file>``.

    Attributes: ``host``, ``port``, ``url`` (``redis://[:password@]127.0.0.1:port``),
    ``proc`` (the ``subprocess.Popen``, ``None`` before start), ``dir``, ``log_path``.

    Raises (``start``/``restart``):
        RedisNotInstalled: no ``redis-server``.
        RuntimeError: it exited or did not answer PING in time (the message has its log tail).
    """

    host = "127.0.0.1"

    def __init__(self, workdir: str | os.PathLike, port: int | None = None,
                 password: str | None = None, maxmemory: int | None = None,
                 maxmemory_policy: str | None = None, cluster: bool = False,
                 extra_args: tuple[str, ...] | list[str] = (), startup_timeout_s: float = 10.0,
                 tls: tuple[str, str, str] | None = None):
        if maxmemory is not None and maxmemory < 0:
            raise ValueError(f"maxmemory must be >= 0 bytes, got {maxmemory}")
        self._fixed_port = port is not None
        self.port = port or free_port()
        self.cluster_port = free_port() if cluster else None  # the cluster bus
        self.password = password
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.cluster = cluster
        self.extra_args = tuple(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.tls = tuple(str(f) for f in tls) if tls else None
        self.workdir = Path(workdir)
        self.proc: subprocess.Popen | None = None
        self._started_once = False

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}{self.host}:{self.port}?ssl_ca_certs={self.tls[2]}"
        return f"redis://{auth}{self.host}:{self.port}"

    @property
    def dir(self) -> Path:
        return self.workdir / f"redis-{self.port}"

    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    @property
    def alive(self) -> bool:
        """Whether the process is running (it may still be starting)."""
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        """The ``redis-server`` command line (the password appears in it)."""
        port = ["--port", str(self.port)]
        if self.tls:
            port = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls[0],
                    "--tls-key-file", self.tls[1], "--tls-ca-cert-file", self.tls[2],
                    "--tls-auth-clients", "optional"]
        cmd = [redis_binary(), *port, "--bind", self.host,
               "--save", "", "--appendonly", "no", "--dir", str(self.dir),
               "--proto-max-bulk-len", "1gb", "--daemonize", "no"]
        if self.password:
            cmd += ["--requirepass", self.password]
        if self.maxmemory is not None:
            cmd += ["--maxmemory", str(self.maxmemory)]
        if self.maxmemory_policy:
            cmd += ["--maxmemory-policy", self.maxmemory_policy]
        if self.cluster and self.tls:  # (the cluster bus over TLS too)
            cmd += ["--tls-cluster", "yes", "--tls-replication", "yes"]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes",
                    "--cluster-config-file", str(self.dir / "nodes.conf"),
                    "--cluster-port", str(self.cluster_port),
                    "--cluster-node-timeout", "2000",
                    "--cluster-require-full-coverage", "no"]
        return cmd + list(self.extra_args)

    def start(self) -> "RedisServer":
        """Start the process and wait until it answers PING (with AUTH when a password is
        set). Blocks up to ``startup_timeout_s``. Does nothing when already alive."""
        if self.alive:
            return self
        for attempt in range(3):
            try:
                self._spawn()
                return self
            except _PortTaken:
                if self._fixed_port or self._started_once or attempt == 2:
                    ports = f"{self.port}" + (f" or {self.cluster_port}" if self.cluster else "")
                    raise RuntimeError(f"redis-server: port {ports} is in use:\n"
                                       f"{_tail(self.log_path)}") from None
                self.port = free_port()  # lost a race for a port picked as free: pick again
                self.cluster_port = free_port() if self.cluster else None
        return self

    def _spawn(self) -> None:
        cmd = self.command()
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        _track(self.proc)
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        self._started_once = True

    def _wait_ready(self) -> None:
        import redis
        deadline = time.monotonic() + self.startup_timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "Address already in use" in _tail(self.log_path, 5):
                    raise _PortTaken()
                raise RuntimeError(f"redis-server on port {self.port} exited with "
                                   f"{self.proc.returncode}:\n{_tail(self.log_path)}")
            try:
                with self.client(socket_timeout=0.5) as r:
                    if r.ping():
                        return
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                    redis.exceptions.BusyLoadingError) as e:
                last = repr(e)
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within "
                           f"{self.startup_timeout_s:.0f} s ({last}):\n{_tail(self.log_path)}")

    def client(self, **kwargs):
        """A new ``redis.Redis`` connected to this server (with its password); ``kwargs`` go to
        ``redis.Redis`` (defaults: ``socket_timeout=5`` s, no retries, so a dead server fails
        the first command at once). Close it, or use it in ``with``."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        kwargs.setdefault("socket_timeout", 5.0)
        kwargs.setdefault("retry", Retry(NoBackoff(), 0))
        if self.tls:
            kwargs.setdefault("ssl", True)
            kwargs.setdefault("ssl_ca_certs", self.tls[2])
            # (its own certificate as the client's: signed by the same CA, it passes a
            # server that asks clients for one)
            kwargs.setdefault("ssl_certfile", self.tls[0])
            kwargs.setdefault("ssl_keyfile", self.tls[1])
        return redis.Redis(host=self.host, port=self.port, password=self.password, **kwargs)

    def stop(self) -> None:
        """SIGTERM the process (SIGKILL after 5 s) and wait for it. Idempotent."""
        if self.proc is not None:
            kill_process(self.proc, grace_s=5.0)

    def kill(self) -> None:
        """SIGKILL the process, as a crash would, and reap it. Idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait(timeout=10)
        _LIVE.discard(self.proc)

    def restart(self) -> "RedisServer":
        """Kill the process if alive and start a new one on the same port: it starts EMPTY (no
        persistence). A cluster node keeps its ``nodes.conf``, so it rejoins the cluster owning
        the same slots, with no keys."""
        self.kill()
        return self.start()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "alive" if self.alive else "stopped"
        return f"RedisServer({self.host}:{self.port}, {state}, cluster={self.cluster})"
