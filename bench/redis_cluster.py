"""A Redis Cluster of real ``redis-server`` processes (``bench.redis_servers.RedisServer``) on
free loopback ports, for tests and benchmarks.

    with RedisClusterGroup(workdir, masters=3) as grp:   # 3 masters, 16384 slots, no replicas
        grp.client().set(b"k", b"v"); grp.kill_node(grp.node_for_key(b"k"))
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

from bench.redis_servers import RedisServer, redis_binary

#: hash slots of a Redis Cluster
NUM_SLOTS = 16384


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
