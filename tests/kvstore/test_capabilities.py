"""Declared capabilities (``KVStoreBase.capabilities``): each store's declaration matches what
it does: an operation declared is served, one not declared is absent, and the daemon reads the
declaration to pick its data path."""
import dataclasses
import time

import pytest
import torch

from kvstore.api import KVStoreBase, LookupResult, StoreCapabilities
from kvstore.config import StoreConfig
from kvstore.daemon.client import KVStoreClient, StoreUnavailable
from kvstore.daemon.server import STATE_KEY, ServerLimits, ThreadedServer, create_app
from kvstore.direct import BorrowedChunks, Reservation
from kvstore.keys import Namespace
from kvstore.layered import CircuitBreakerStore, LayeredStore
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", chunk_size=4)
NS = Namespace("tiny-model", LAYOUT)
KEYS = NS.chunk_keys(list(range(4 * 3)))  # 3 chained chunk keys


def chunk(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape(), generator=g).to(torch.float16)  # [2, 2, 4, 1, 8]


def cpu_store(**kw) -> ChunkStore:
    return ChunkStore(StoreConfig(cpu_bytes=1 << 20, page_bytes=256, **kw))


@pytest.fixture
def daemon():
    store = cpu_store()
    srv = ThreadedServer(create_app(store, ServerLimits()))
    srv.store = store
    yield srv
    srv.stop()
    store.close()


def test_a_store_declaring_nothing_offers_no_optional_operation():
    class Bare(KVStoreBase):
        lookup_keys = get_chunks = put_chunks = exists = remove = clear = None
        pin = unpin = stats = None

    bare = Bare()
    assert bare.capabilities == StoreCapabilities()
    assert not bare.capabilities.has_lower_tiers
    assert bare.register(NS) is None  # the default checks nothing and raises nothing
    with pytest.raises(dataclasses.FrozenInstanceError):  # frozen: a declaration cannot be changed by a caller
        bare.capabilities.remote = True


def test_chunk_store_with_a_disk_tier_serves_everything_it_declares(tmp_path):
    kvs = [chunk(i) for i in range(3)]
    with cpu_store(disk_path=str(tmp_path / "d"), disk_bytes=8 << 20) as s:
        caps = s.capabilities
        assert caps == StoreCapabilities(
            remote=False, borrowed_reads=True, reservations=True, pins=True, durable_puts=True,
            nonblocking_lookup=True, get_takes_parents=False, get_into_buffers=True,
            copies_on_put=True, tiers=("cpu", "disk"))
        assert caps.has_lower_tiers
        # reservations: bytes written into reserved pages become the stored chunk
        res = s.reserve_chunks(NS, KEYS[:1])
        assert isinstance(res[0], Reservation)
        res[0].views[0].copy_(kvs[0].reshape(-1).view(torch.uint8)[:res[0].views[0].numel()])
        off = res[0].views[0].numel()
        for v in res[0].views[1:]:
            v.copy_(kvs[0].reshape(-1).view(torch.uint8)[off:off + v.numel()])
            off += v.numel()
        assert s.commit_chunks(NS, KEYS[:1], res) == 1
        # copies_on_put: the caller's tensor changed after the put does not change the chunk
        src = kvs[1].clone()
        assert s.put_chunks(NS, KEYS[1:2], [src], [KEYS[0]]) == 1
        src.zero_()
        # nonblocking_lookup: the same answer as lookup_keys while the lock is free
        assert s.try_lookup_keys(NS, KEYS) == s.lookup_keys(NS, KEYS) == LookupResult(
            2, 4, ("cpu", "cpu"), 3)
        # get_into_buffers: memory hits land in the caller's tensors
        out = [torch.empty(LAYOUT.shape(), dtype=torch.float16) for _ in range(2)]
        got = s.get_chunks(NS, KEYS[:2], out=out)
        assert got[0] is out[0] and got[1] is out[1]
        assert torch.equal(out[0], kvs[0]) and torch.equal(out[1], kvs[1])
        # borrowed_reads: views of the stored pages, the same bytes get_chunks returns
        with s.borrow_chunks(NS, KEYS) as b:
            assert isinstance(b, BorrowedChunks) and b.lower == [] and b.parts[2] is None
            assert torch.equal(torch.cat(b.parts[0]), kvs[0].reshape(-1).view(torch.uint8))
            assert s.pin_count(KEYS[0]) == 1  # reader-pinned while borrowed
        assert s.pin_count(KEYS[0]) == 0
        # pins
        assert s.pin(NS, KEYS[:2]) == 2 and s.pin_count(KEYS[1]) == 1
        assert s.unpin(NS, KEYS[:2]) == 2
        # durable_puts: persist commits to the disk tier
        assert s.persist(NS, KEYS[2:], kvs[2:], timeout=10.0, parents=[KEYS[1]]) == 1
        assert s.tiers[1].contains(KEYS[2]) and not s.tiers[0].contains(KEYS[2])


def test_chunk_store_without_a_disk_tier_declares_no_durable_puts():
    with cpu_store() as s:
        caps = s.capabilities
        assert (caps.durable_puts, caps.tiers, caps.has_lower_tiers) == (False, ("cpu",), False)
        with pytest.raises(RuntimeError, match="persist needs a disk tier"):
            s.persist(NS, KEYS[:1], [chunk(0)])


def test_a_chunk_store_whose_reads_are_redefined_declares_no_borrowed_reads():
    """Borrowed reads would bypass a redefined ``get_chunks`` (e.g. one injecting faults)."""
    class Faulty(ChunkStore):
        def get_chunks(self, ns, keys, out=None):
            return [None] * len(keys)

    with Faulty(StoreConfig(cpu_bytes=1 << 20, page_bytes=256)) as s:
        assert s.capabilities.borrowed_reads is False
        assert s.capabilities.reservations is True and s.capabilities.pins is True


def test_client_declares_remote_and_no_direct_io(daemon):
    with KVStoreClient(daemon.url, timeout_s=5.0) as c:
        caps = c.capabilities
        # get_chunks(out=) fills caller buffers on both paths (HTTP and the same-host socket)
        assert caps == StoreCapabilities(remote=True, pins=True, get_into_buffers=True,
                                         tiers=("remote",))
        assert not hasattr(c, "borrow_chunks") and not hasattr(c, "reserve_chunks")
        assert not hasattr(c, "persist") and not hasattr(c, "try_lookup_keys")
        assert c.put_chunks(NS, KEYS[:2], [chunk(0), chunk(1)]) == 2
        assert c.pin(NS, KEYS[:2]) == 2 and daemon.store.pin_count(KEYS[0]) == 1
        assert c.unpin(NS, KEYS[:2]) == 2 and daemon.store.pin_count(KEYS[0]) == 0


def test_remote_calls_block_up_to_the_clients_deadline_then_raise():
    """``remote``: a call may block until the deadline; it never hangs beyond it."""
    import socket
    with socket.socket() as lsn:  # accepts connections (the kernel backlog) but never answers
        lsn.bind(("127.0.0.1", 0))
        lsn.listen(8)
        with KVStoreClient(f"http://127.0.0.1:{lsn.getsockname()[1]}", timeout_s=0.5) as c:
            assert c.capabilities.remote
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                c.lookup_keys(NS, KEYS)
            assert 0.4 < time.monotonic() - t0 < 3.0


def test_layered_store_declares_parents_on_get_and_local_then_remote_tiers(daemon):
    with cpu_store() as local, KVStoreClient(daemon.url, timeout_s=5.0) as c:
        layered = LayeredStore(local, c)
        caps = layered.capabilities
        assert caps == StoreCapabilities(remote=True, pins=True, get_takes_parents=True,
                                         tiers=("cpu", "remote"))
        assert not hasattr(layered, "borrow_chunks") and not hasattr(layered, "persist")
        # get_takes_parents: remote hits are copied into the local store with the given parents
        assert c.put_chunks(NS, KEYS, [chunk(i) for i in range(3)]) == 3
        local.put_chunks(NS, KEYS[:1], [chunk(0)])
        got = layered.get_chunks(NS, KEYS[1:], parents=[KEYS[0], KEYS[1]])
        assert [torch.equal(g, chunk(i + 1)) for i, g in enumerate(got)] == [True, True]
        assert [local.tiers[0].parent_of(k) for k in KEYS] == [None, KEYS[0], KEYS[1]]


def test_circuit_breaker_declares_remote_and_forwards_no_optional_operation():
    with cpu_store() as inner:
        br = CircuitBreakerStore(inner)
        assert br.capabilities == StoreCapabilities(remote=True, pins=True, tiers=("remote",))
        assert not hasattr(br, "borrow_chunks") and not hasattr(br, "try_lookup_keys")


def test_daemon_picks_its_data_path_from_the_declaration(tmp_path):
    with cpu_store(disk_path=str(tmp_path / "d"), disk_bytes=8 << 20) as s:
        state = create_app(s)[STATE_KEY]
        assert (state.direct, state.reuse_put_buffers, state.get_into_buffers) == (
            True, True, True)
        state.pool.shutdown()
        # the same store behind a breaker declares none of those: buffers, no direct I/O
        state = create_app(CircuitBreakerStore(s))[STATE_KEY]
        assert (state.direct, state.reuse_put_buffers, state.get_into_buffers) == (
            False, False, False)
        state.pool.shutdown()


def test_stored_keys_and_metrics_registry_come_from_the_store_not_from_probes(tmp_path, daemon):
    """The daemon's /v1/stats namespaces and /metrics read ``stored_keys`` and
    ``metrics_registry``: a ChunkStore answers with the keys of every tier (a CPU tier of two
    chunks spills the third to disk) and its own registry; a client holds no chunks."""
    s = ChunkStore(StoreConfig(cpu_bytes=LAYOUT.chunk_bytes * 2, page_bytes=256,
                               disk_path=str(tmp_path), disk_bytes=1 << 20))
    try:
        assert s.stored_keys() == set()
        assert s.put_chunks(NS, KEYS, [chunk(i) for i in range(3)]) == 3
        s.flush()
        assert len(s.tiers[0].keys()) == 2 and s.stored_keys() == set(KEYS)
        assert s.metrics_registry() is s.metrics.registry
        assert s.metrics_registry().get_sample_value("kvstore_stored_chunks_total") == 3
    finally:
        s.close()
    with KVStoreClient(daemon.url, timeout_s=5.0) as client:
        assert client.put_chunks(NS, KEYS, [chunk(i) for i in range(3)]) == 3
        assert client.stored_keys() == set() and client.metrics_registry() is None
        assert daemon.store.stored_keys() == set(KEYS)


def test_a_store_that_redefines_lookup_keys_declares_no_nonblocking_lookup():
    class CountingStore(ChunkStore):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.lookups = 0

        def lookup_keys(self, ns, keys):
            self.lookups += 1
            return super().lookup_keys(ns, keys)

    with cpu_store() as plain:
        assert plain.capabilities.nonblocking_lookup
    with CountingStore(StoreConfig(cpu_bytes=1 << 20)) as s:
        # try_lookup_keys would go around the subclass's lookup_keys: not offered
        assert s.capabilities.nonblocking_lookup is False
        s.lookup_keys(NS, KEYS)
        assert s.lookups == 1
