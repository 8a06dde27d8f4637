"""What the remote tier logs when Redis refuses writes as full (one WARNING, then at most one
per 10 minutes with the count) and when a down node's failures change cause (a refused
connection, then refused credentials: logged again within a minute, naming the new cause).
Real redis-server processes."""
import logging
import re

from bench.redis_servers import RedisServer
from kvstore.tiers.remote import RemoteTier
from tests.kvstore.remote_helpers import NS, count, make_store, prompt
from tests.redis_fixtures import redis_server, require_redis  # noqa: F401

LOGGER = "kvstore.tiers.remote"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING]


def test_a_full_redis_is_logged_once_with_the_cause_and_then_counted(tmp_path, caplog):
    require_redis()
    N = 300
    with RedisServer(tmp_path, maxmemory_policy="noeviction") as srv:
        with srv.client() as r:
            used = int(r.info("memory")["used_memory"])
            r.config_set("maxmemory", used + 100 * 1024)
        with caplog.at_level(logging.INFO, logger=LOGGER):
            with make_store(srv.url, cpu_chunks=2 * N) as s:
                keys, kvs = prompt(NS, 0, N)
                assert s.put_chunks(NS, keys, kvs) == N and s.flush(10.0)
                more, more_kvs = prompt(NS, 1, N)
                assert s.put_chunks(NS, more, more_kvs) == N and s.flush(10.0)
                full = count(s.remote, "dropped_writes", "full")
        assert full > N  # the second prompt found Redis full from its first write
        warn = [w for w in _warnings(caplog) if "refused" in w]
        assert len(warn) == 1, warn
        assert re.fullmatch(
            rf"remote tier: Redis node 127\.0\.0\.1:{srv.port} refused 1 write\(s\): it is full "
            r"\(maxmemory reached .*\); those chunks stay local only "
            r"\(kvstore_remote_dropped_writes_total\{reason=\"full\"\}; logged again at most "
            r"every 600 s\)", warn[0]), warn[0]


def test_a_node_back_with_a_password_is_logged_again_naming_the_refused_credentials(
        redis_server, caplog):
    now = [1000.0]
    tier = RemoteTier(redis_server.url, timeout_s=2.0, breaker_threshold=3,
                      breaker_reset_s=5.0, clock=lambda: now[0])
    node = f"127.0.0.1:{redis_server.port}"
    keys, _ = prompt(NS, 0, 1)
    locked = None
    try:
        assert tier.lookup(keys) == [False]
        with caplog.at_level(logging.INFO, logger=LOGGER):
            redis_server.kill()
            for _ in range(30):                     # refused for 30 s: the "down" line
                tier.lookup(keys)
                now[0] += 1.0
            assert len(_warnings(caplog)) == 1 and "ConnectionError" in _warnings(caplog)[0]
            locked = RedisServer(redis_server.workdir, port=redis_server.port,
                                 password="sekrit-pw").start()
            for _ in range(60):                     # a trial call every 5 s: refused AUTH
                tier.lookup(keys)
                now[0] += 1.0
            warn = _warnings(caplog)
            assert len(warn) == 2, warn             # the new cause, not 10 minutes later
            assert warn[1].startswith(f"remote tier: node {node} still down after ")
            assert "AuthenticationError" in warn[1] and "sekrit-pw" not in warn[1]
            for _ in range(120):                    # the same cause: nothing more
                tier.lookup(keys)
                now[0] += 1.0
            assert len(_warnings(caplog)) == 2
    finally:
        tier.close(flush_timeout=1.0)
        if locked is not None:
            locked.stop()
