"""Two daemons, each with its own ChunkStore over one Redis Cluster: a chunk put through one
daemon's client is a bit-exact hit through the other's, found in its remote tier."""
import pytest

from kvstore.api import LookupResult
from kvstore.config import StoreConfig
from kvstore.daemon.client import KVStoreClient
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.store import ChunkStore
from tests.kvstore.remote_helpers import CB, NS, prompt, rkey, same

TOKEN = "daemon-remote-token"


@pytest.fixture
def daemons(shared_redis_cluster):
    """Daemons A and B: their servers and clients."""
    out = []
    for _ in range(2):
        store = ChunkStore(StoreConfig(cpu_bytes=64 * CB, page_bytes=CB,
                                       remote_url=shared_redis_cluster.url))
        srv = ThreadedServer(create_app(store, ServerLimits(auth_token=TOKEN)))
        srv.store = store
        out.append((srv, KVStoreClient(srv.url, auth_token=TOKEN, timeout_s=5.0)))
    yield out
    for srv, client in out:
        client.close()
        srv.stop()
        srv.store.close()


def redis_keys(cluster) -> set[bytes]:
    out = set()
    for node in cluster.nodes:
        with node.client() as r:
            out |= set(r.keys("*"))
    return out


def test_a_chunk_put_through_daemon_a_is_a_hit_through_daemon_b(
        daemons, shared_redis_cluster):
    (srv_a, client_a), (srv_b, client_b) = daemons
    keys, kvs = prompt(NS, 0, 8)
    assert client_a.put_chunks(NS, keys, kvs) == 8
    assert srv_a.store.flush(5.0)  # A's write-behind queue is written
    assert redis_keys(shared_redis_cluster) == {rkey(k) for k in keys}
    assert client_b.lookup_keys(NS, keys) == LookupResult(8, 4, ("remote",) * 8, 8)
    assert client_b.exists(NS, keys) == [True] * 8
    assert same(client_b.get_chunks(NS, keys), kvs)
    # B promoted them into its own CPU tier
    assert client_b.lookup_keys(NS, keys) == LookupResult(8, 4, ("cpu",) * 8, 8)
    assert srv_b.store.remote.metrics.count("hits") == 8
    assert srv_b.store.remote.metrics.count("writes") == 0
    # a prompt that extends it: B sees the shared head, not A's unwritten tail
    longer, _ = prompt(NS, 0, 10)
    assert client_b.lookup_keys(NS, longer) == LookupResult(8, 4, ("cpu",) * 8, 10)
    # removal through A reaches Redis; B's promoted copies are its own
    assert client_a.remove(NS, keys[4:]) == 4
    assert redis_keys(shared_redis_cluster) == {rkey(k) for k in keys[:4]}
    assert client_b.lookup_keys(NS, keys).tiers == ("cpu",) * 8
    assert 'kvstore_remote_hits_total 8.0' in client_b.metrics_text()
