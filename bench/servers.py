"""Start and stop the processes of one benchmark configuration on free loopback ports.

Configurations (all engines get the same small KV pool, so only the reuse path differs):

    recompute       engine --no-prefix-caching                (no reuse at all)
    engine-cache    engine                                     (engine's own prefix cache)
    kvstore-cpu     engine --kvstore-cpu-bytes CPU             (in-process CPU tier)
    kvstore-disk    engine --kvstore-cpu-bytes TINY --kvstore-disk-path TMP --kvstore-disk-bytes D
    kvstore-remote  daemon + engine --kvstore-url               (daemon started here)
    shared          daemon + 2 engines --kvstore-url            (requests spread round-robin)

``ServerGroup(..., num_engines=N)`` starts N engines of any configuration (the ``kvstore-*``
ones all connect to the same store: one daemon for ``kvstore-remote``), and
``router_policy="cache-aware"`` (or ``"round-robin"``) puts one router in front of them
(``python -m engine_min route --engines URL,... --policy P``, plus ``--kvstore-url`` of the
group's daemon when there is one), started together with the
engines (it waits for their ``/health`` itself); ``g.router_url`` is then the single URL to send
requests to.

The daemon also listens on a Unix socket (``--unix-socket``, unless ``daemon_unix_socket`` is
off), so its engines, on the same host, find it through ``/v1/stats`` and load through shared
memory, as a same-host deployment does; off, they use HTTP.

``ServerGroup`` is a context manager: every process it started (each in its own process group)
is terminated on exit, on an exception, on Ctrl-C, on SIGTERM, and at interpreter exit.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_NAMES = ("recompute", "engine-cache", "kvstore-cpu", "kvstore-disk", "kvstore-remote",
                "shared")

_LIVE: set[subprocess.Popen] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServerOptions:
    """Sizes and knobs of the started servers (sizes as the servers parse them, e.g. "96MiB").

    Attributes:
        kv_cache_bytes: the engine's KV pool (the same small pool for every configuration).
        kvstore_cpu_bytes: CPU tier of ``kvstore-cpu`` and of the daemon.
        tiny_cpu_bytes: CPU tier of ``kvstore-disk`` (the disk tier holds the rest).
        disk_bytes: disk tier of ``kvstore-disk``.
        max_num_batched_tokens: the engine's per-step token budget (``None``: its default).
        threads: torch threads per engine (``None``: cores divided by the engines started).
        engine_args / daemon_args: extra flags appended verbatim.
        policy: the daemon's eviction policy.
        kvstore_chunk_size: store chunk size in tokens for engines with a store (``None``: the
            server's default).
        daemon_unix_socket: the daemon offers its same-host path (``--unix-socket`` in a
            temporary folder), which its engines use by themselves; False: HTTP only.
        startup_timeout_s: how long to wait for ``/health``.
        log_dir: where process logs go (a temporary folder when ``None``).
    """

    kv_cache_bytes: str = "64MiB"
    kvstore_cpu_bytes: str = "2GiB"
    tiny_cpu_bytes: str = "32MiB"
    disk_bytes: str = "4GiB"
    max_num_batched_tokens: int | None = None
    threads: int | None = None
    engine_args: tuple[str, ...] = ()
    daemon_args: tuple[str, ...] = ()
    policy: str = "lru"
    kvstore_chunk_size: int | None = None
    daemon_unix_socket: bool = True
    startup_timeout_s: float = 300.0
    log_dir: str | None = None


def _engine_cmd(port: int, opts: ServerOptions, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "engine_min.serve.server", "--host", "127.0.0.1", "--port", str(port),
           "--kv-cache-bytes", opts.kv_cache_bytes]
    if opts.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(opts.max_num_batched_tokens)]
    return cmd + extra + list(opts.engine_args)


def _daemon_cmd(port: int, opts: ServerOptions, unix_socket: str | None = None) -> list[str]:
    return [sys.executable, "-m", "kvstore", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--cpu-bytes", opts.kvstore_cpu_bytes, "--policy", opts.policy,
            *(["--unix-socket", unix_socket] if unix_socket else []), *opts.daemon_args]


def _router_cmd(port: int, engine_urls: list[str], policy: str, startup_timeout_s: float,
                extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "engine_min", "route", "--engines", ",".join(engine_urls),
            "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
            "--startup-timeout-s", f"{startup_timeout_s:g}", *extra]


def engine_help() -> str:
    """``python -m engine_min.serve.server --help`` output ("" if the module cannot run)."""
    try:
        return subprocess.run([sys.executable, "-m", "engine_min.serve.server", "--help"],
                              capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


@dataclass
class Proc:
    """One started process: its role (``engine0``, ``daemon``...), URL, log file, command."""

    role: str
    url: str
    health_path: str
    popen: subprocess.Popen
    log_path: Path
    cmd: list[str] = field(default_factory=list)


@dataclass
class ServerGroup:
    """The processes of one configuration. Use as ``with ServerGroup(name, opts) as g:``; then
    ``g.engine_urls`` are the engines' base URLs (one, or two for ``shared``; ``num_engines``
    when given) and ``g.router_url`` the router's (``None`` without ``router_policy``).

    Attributes:
        num_engines: engines to start (``None``: 2 for ``shared``, else 1). Every engine of a
            ``kvstore-remote`` group connects to the group's one daemon.
        router_policy: start ``python -m engine_min route`` in front of the engines with this
            ``--policy`` (``None``: no router).
        router_args: extra router flags appended verbatim.
        tag: names the log files (``TAG-ROLE.log``; default: the configuration name).

    Raises (on enter):
        ValueError: unknown configuration name, ``num_engines`` < 1.
        RuntimeError: a process exited or did not become healthy in time (message has the
            tail of its log); everything already started is stopped first.
    """

    name: str
    opts: ServerOptions = field(default_factory=ServerOptions)
    no_prefix_caching_flag: bool = True
    num_engines: int | None = None
    router_policy: str | None = None
    router_args: tuple[str, ...] = ()
    tag: str | None = None
    procs: list[Proc] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _tmp: list[str] = field(default_factory=list)

    @property
    def engine_urls(self) -> list[str]:
        return [p.url for p in self.procs if p.role.startswith("engine")]

    @property
    def router_url(self) -> str | None:
        """The router's base URL, ``None`` when the group has no router."""
        return next((p.url for p in self.procs if p.role == "router"), None)

    @property
    def metric_urls(self) -> dict[str, str]:
        """Role -> base URL of every started process (each serves ``/metrics``)."""
        return {p.role: p.url for p in self.procs}

    def __enter__(self) -> "ServerGroup":
        if self.name not in CONFIG_NAMES:
            raise ValueError(f"unknown configuration {self.name!r}; known: {CONFIG_NAMES}")
        if self.num_engines is not None and self.num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {self.num_engines}")
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self) -> None:
        n_engines = self.num_engines or (2 if self.name == "shared" else 1)
        threads = self.opts.threads or max(1, (os.cpu_count() or 1) // n_engines)
        extra: list[str] = []
        daemon_url = None
        if self.name == "recompute":
            if self.no_prefix_caching_flag:
                extra = ["--no-prefix-caching"]
            else:
                self.notes.append("engine_min.serve.server has no --no-prefix-caching: 'recompute' "
                                  "ran with the engine's prefix cache on")
        elif self.name == "kvstore-cpu":
            extra = ["--kvstore-cpu-bytes", self.opts.kvstore_cpu_bytes]
        elif self.name == "kvstore-disk":
            disk = tempfile.mkdtemp(prefix="bench-kvdisk-")
            self._tmp.append(disk)
            extra = ["--kvstore-cpu-bytes", self.opts.tiny_cpu_bytes, "--kvstore-disk-path", disk,
                     "--kvstore-disk-bytes", self.opts.disk_bytes]
        elif self.name in ("kvstore-remote", "shared"):
            port, sock = free_port(), None
            if self.opts.daemon_unix_socket:
                sock_dir = tempfile.mkdtemp(prefix="bench-kvsock-")
                self._tmp.append(sock_dir)
                sock = os.path.join(sock_dir, "kvstore.sock")
            self._spawn("daemon", _daemon_cmd(port, self.opts, sock), port, "/healthz", threads)
            extra = ["--kvstore-url", f"http://127.0.0.1:{port}"]
            daemon_url = extra[1]
        if extra and self.name != "recompute" and self.opts.kvstore_chunk_size:
            extra += ["--kvstore-chunk-size", str(self.opts.kvstore_chunk_size)]
        for i in range(n_engines):
            port = free_port()
            self._spawn(f"engine{i}", _engine_cmd(port, self.opts, extra), port, "/health",
                        threads)
        if self.router_policy:  # it waits for the engines' /health itself, meanwhile it loads
            port = free_port()  # its tokenizer
            args = self.router_args   # the router discounts what the shared daemon holds
            if daemon_url and "--kvstore-url" not in args:
                args = ("--kvstore-url", daemon_url, *args)
            self._spawn("router", _router_cmd(port, self.engine_urls, self.router_policy,
                                              self.opts.startup_timeout_s, args),
                        port, "/health", 1)
        for p in self.procs:
            self._wait_healthy(p)

    def _log_dir(self) -> Path:
        if self.opts.log_dir:
            d = Path(self.opts.log_dir)
            d.mkdir(parents=True, exist_ok=True)
            return d
        d = tempfile.mkdtemp(prefix="bench-logs-")
        self._tmp.append(d)
        return Path(d)

    def _spawn(self, role: str, cmd: list[str], port: int, health: str, threads: int) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads),
                   MKL_NUM_THREADS=str(threads))
        log_path = self._log_dir() / f"{self.tag or self.name}-{role}.log"
        with open(log_path, "wb") as log:
            log.write((" ".join(cmd) + "\n").encode())
            log.flush()
            popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        _LIVE.add(popen)
        self.procs.append(Proc(role, f"http://127.0.0.1:{port}", health, popen, log_path,
                               [f"OMP_NUM_THREADS={threads}", *cmd]))

    def _wait_healthy(self, p: Proc) -> None:
        deadline = time.monotonic() + self.opts.startup_timeout_s
        while time.monotonic() < deadline:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{self.name}/{p.role} exited with {p.popen.returncode}:\n"
                                   f"{_tail(p.log_path)}")
            try:
                with urllib.request.urlopen(p.url + p.health_path, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name}/{p.role} not healthy after "
                           f"{self.opts.startup_timeout_s:.0f}s:\n{_tail(p.log_path)}")

    def stop(self) -> None:
        """Terminate every process and remove temp dirs: the router first (it holds long
        polls open on the engines, which would hold up their exit), then the engines together,
        then the daemon. Idempotent."""
        stages = [[p for p in self.procs if p.role == "router"],
                  [p for p in self.procs if p.role not in ("router", "daemon")],
                  [p for p in self.procs if p.role == "daemon"]]
        for stage in stages:
            kill_processes([p.popen for p in stage])
        self.procs.clear()
        for d in self._tmp:
            shutil.rmtree(d, ignore_errors=True)
        self._tmp.clear()

    def commands(self) -> dict[str, str]:
        """Role -> command line (with ``OMP_NUM_THREADS``) of every started process."""
        return {p.role: " ".join(p.cmd) for p in self.procs}

    def logs(self) -> dict[str, str]:
        """Role -> log path, for error messages."""
        return {p.role: str(p.log_path) for p in self.procs}


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def kill_process(popen: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group of ``popen``, SIGKILL it after ``grace_s``. Safe to repeat."""
    kill_processes([popen], grace_s)


def kill_processes(popens: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """``kill_process`` on several processes at once: SIGTERM to every process group first,
    then wait for each (at most ``grace_s`` in all before SIGKILL). Safe to repeat."""
    for popen in popens:
        if popen.poll() is None:
            try:
                os.killpg(popen.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + grace_s
    for popen in popens:
        try:
            popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            popen.wait(timeout=grace_s)
        _LIVE.discard(popen)


def _kill_all() -> None:
    for popen in list(_LIVE):
        kill_process(popen, grace_s=5.0)


def install_cleanup_handlers() -> None:
    """Make SIGTERM raise ``SystemExit`` (so ``with ServerGroup`` blocks stop their processes)
    and stop any process still alive at interpreter exit. Call once from an entry point."""
    atexit.register(_kill_all)

    def _on_sigterm(signum, frame):
        raise SystemExit(128 + signum)

    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread
        pass
