"""Real ``redis-server`` processes on free loopback ports, for tests and benchmarks.

    with RedisServer(workdir) as srv:                    # standalone, no persistence
        srv.client().set(b"k", b"v"); srv.kill(); srv.restart()   # back on the same port, empty
    with RedisClusterGroup(workdir, masters=3) as grp:   # 3 masters, 16384 slots, no replicas
        grp.client().set(b"k", b"v"); grp.kill_node(grp.node_for_key(b"k"))

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

NUM_SLOTS = 16384
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


class RedisClusterGroup:
    """A Redis Cluster of ``masters`` masters without replicas on 127.0.0.1, created with
    ``redis-cli --cluster create``. Use as ``with RedisClusterGroup(workdir) as grp:``.

    ``cluster-require-full-coverage`` is off, so after ``kill_node(i)`` the other masters keep
    serving their slots (the killed node's slots fail). ``cluster-node-timeout`` is 2 s.

    Attributes:
        nodes: the masters (``RedisServer``), in ``startup_nodes`` order.
        startup_nodes: ``[(host, port)]`` of every master.
        url: ``redis://[:password@]127.0.0.1:p1,127.0.0.1:p2,...`` (the remote tier's form;
            ``rediss://...?ssl_ca_certs=<CA file>`` with ``tls``: ``(cert, key, CA)`` files,
            every node and the cluster bus speaking TLS only, as ``RedisServer``'s).
        startup_s: seconds ``start()`` took (processes up to every node ``cluster_state:ok``).

    Raises (``start``):
        ValueError: ``masters`` < 3 (``redis-cli --cluster create`` needs 3).
        RedisNotInstalled: no ``redis-server`` or ``redis-cli``.
        RuntimeError: a server did not start, ``redis-cli`` failed (its output is in the
            message), or the cluster did not reach ``cluster_state:ok`` in time.
    """

    def __init__(self, workdir: str | os.PathLike, masters: int = 3,
                 password: str | None = None, ready_timeout_s: float = 20.0,
                 tls: tuple[str, str, str] | None = None):
        if masters < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 masters, got {masters}")
        self.workdir = Path(workdir)
        self.password = password
        self.ready_timeout_s = ready_timeout_s
        self.tls = tuple(str(f) for f in tls) if tls else None
        self.nodes = [RedisServer(self.workdir, password=password, cluster=True, tls=tls)
                      for _ in range(masters)]
        self.startup_s = 0.0
        self._slot_owner: list[tuple[int, int, int]] = []  # (first slot, last slot, node index)

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(n.host, n.port) for n in self.nodes]

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        hosts = ",".join(f"{h}:{p}" for h, p in self.startup_nodes)
        if self.tls:
            return f"rediss://{auth}{hosts}?ssl_ca_certs={self.tls[2]}"
        return f"redis://{auth}{hosts}"

    def start(self) -> "RedisClusterGroup":
        """Start every node, create the cluster and wait until it is ready (blocks seconds)."""
        cli = redis_binary("redis-cli")
        t0 = time.monotonic()
        try:
            for node in self.nodes:
                node.start()
            self._create(cli)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _create(self, cli: str) -> None:
        cmd = [cli, "--cluster", "create", *(f"{h}:{p}" for h, p in self.startup_nodes),
               "--cluster-replicas", "0", "--cluster-yes"]
        if self.password:
            cmd += ["-a", self.password, "--no-auth-warning"]
        if self.tls:
            cmd += ["--tls", "--cacert", self.tls[2], "--cert", self.tls[0], "--key", self.tls[1]]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL)
        if res.returncode != 0 or "[OK] All 16384 slots covered" not in res.stdout:
            shown = " ".join(c if c != self.password else "***" for c in cmd)
            raise RuntimeError(f"`{shown}` failed (exit {res.returncode}):\n"
                               f"{res.stdout[-3000:]}{res.stderr[-2000:]}")

    def wait_ready(self) -> None:
        """Block (up to ``ready_timeout_s``) until every node answers ``cluster_state:ok``, all
        16384 slots assigned and every master known; then record the slot owners.

        Raises:
            RuntimeError: not ready in time (the message has each node's CLUSTER INFO).
        """
        import redis
        deadline = time.monotonic() + self.ready_timeout_s
        info: dict = {}
        while time.monotonic() < deadline:
            try:
                states = [self._cluster_info(n) for n in self.nodes]
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                states = [{"error": repr(e)}]
            if all(s.get("cluster_state") == "ok"
                   and int(s.get("cluster_slots_assigned", 0)) == NUM_SLOTS
                   and int(s.get("cluster_known_nodes", 0)) == len(self.nodes) for s in states):
                self._slot_owner = self._read_slots()
                return
            info = dict(zip((n.port for n in self.nodes), states))
            time.sleep(0.05)
        raise RuntimeError(f"cluster not ready within {self.ready_timeout_s:.0f} s; "
                           f"CLUSTER INFO per port: {info}")

    @staticmethod
    def _cluster_info(node: RedisServer) -> dict:
        with node.client() as r:
            return r.cluster("INFO")

    def _read_slots(self) -> list[tuple[int, int, int]]:
        index = {port: i for i, (_, port) in enumerate(self.startup_nodes)}
        with self.nodes[0].client() as r:
            raw = r.execute_command("CLUSTER SLOTS")
        owners = sorted((int(s[0]), int(s[1]), index[int(s[2][1])]) for s in raw)
        if sum(last - first + 1 for first, last, _ in owners) != NUM_SLOTS:
            raise RuntimeError(f"CLUSTER SLOTS does not cover {NUM_SLOTS} slots: {owners}")
        return owners

    def node_for_key(self, key: bytes | str) -> int:
        """Index in ``nodes`` of the master that owns ``key``'s slot (hash tags honoured), as
        assigned when the cluster was created."""
        from redis.crc import key_slot
        slot = key_slot(key.encode() if isinstance(key, str) else key)
        for first, last, i in self._slot_owner:
            if first <= slot <= last:
                return i
        raise RuntimeError(f"slot {slot} has no known owner (cluster not started?)")

    def kill_node(self, i: int) -> None:
        """SIGKILL master ``i`` (a crash); its slots fail, the others keep serving."""
        self.nodes[i].kill()

    def flushall(self) -> None:
        """FLUSHALL on every live master (to reuse one cluster across tests)."""
        for node in self.nodes:
            if node.alive:
                with node.client() as r:
                    r.flushall()

    def client(self, **kwargs):
        """A new ``redis.cluster.RedisCluster`` over ``startup_nodes`` (with the password);
        ``kwargs`` go to it. Close it, or use it in ``with``."""
        from redis.cluster import ClusterNode, RedisCluster
        kwargs.setdefault("socket_timeout", 5.0)
        if self.tls:
            kwargs.update(ssl=True, ssl_ca_certs=self.tls[2], ssl_certfile=self.tls[0],
                          ssl_keyfile=self.tls[1])
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.startup_nodes],
                            password=self.password, **kwargs)

    def stop(self) -> None:
        """Stop every node. Idempotent."""
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "RedisClusterGroup":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
