"""An ``http://`` ``KVStoreClient`` that discovered the daemon's Unix socket follows the daemon
across restarts: restarted without a socket, it goes back to HTTP; restarted on another socket
path, it takes the new one; a ``unix://`` client stays on its path. Real ``kvstore serve``
processes restarted on one port; tiny layout (``server_helpers``)."""
from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time

import pytest
import torch

from kvstore.daemon.client import KVStoreClient, StoreUnavailable
from tests.kvstore.daemon.serve_proc import free_port, start, stop
from tests.kvstore.daemon.server_helpers import NS, chunk

KEYS = NS.chunk_keys(list(range(4 * 4)))
WITHIN_S = 10.0  # the client takes what the restarted daemon offers within this (seconds)


def put_until_it_works(c: KVStoreClient, i: int, within_s: float) -> float:
    """Seconds until a put succeeds again (fails the test past ``within_s``)."""
    t0 = time.monotonic()
    while True:
        try:
            assert c.put_chunks(NS, KEYS[i:i + 1], [chunk(i)]) == 1
            return time.monotonic() - t0
        except StoreUnavailable:
            assert time.monotonic() - t0 < within_s, "the client never came back"
            time.sleep(0.1)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_restart_without_the_socket_goes_back_to_http(tmp_path, how):
    port, sock = free_port(), str(tmp_path / "kv.sock")
    proc = start(port, sock)
    try:
        with KVStoreClient(f"http://127.0.0.1:{port}", timeout_s=5.0) as c:
            assert c.put_chunks(NS, KEYS[:1], [chunk(0)]) == 1 and c.transport == "unix"
            stop(proc, how)  # SIGKILL leaves a stale socket file: refused
            assert os.path.exists(sock) == (how == signal.SIGKILL)
            proc = start(port, None)
            took = put_until_it_works(c, 1, within_s=WITHIN_S)
            assert c.transport == "http" and took < WITHIN_S
            assert torch.equal(c.get_chunks(NS, KEYS[1:2])[0], chunk(1))
            assert c.stats()["tiers"]["cpu"]["num_chunks"] == 1  # the new daemon, over HTTP
    finally:
        stop(proc)


def test_restart_on_another_socket_path_takes_the_new_socket(tmp_path):
    port, first, second = free_port(), str(tmp_path / "a.sock"), str(tmp_path / "b.sock")
    proc = start(port, first)
    try:
        with KVStoreClient(f"http://127.0.0.1:{port}", timeout_s=5.0) as c, \
                KVStoreClient("unix://" + first, timeout_s=1.0) as u:
            assert c.put_chunks(NS, KEYS[:1], [chunk(0)]) == 1 and c.transport == "unix"
            assert u.exists(NS, KEYS[:1]) == [True]
            stop(proc)
            proc = start(port, second)
            put_until_it_works(c, 2, within_s=WITHIN_S)
            assert c.transport == "unix" and c.stats()["unix_socket"] == second
            assert c._shm.path == second  # the new socket, not HTTP
            assert torch.equal(c.get_chunks(NS, KEYS[2:3])[0], chunk(2))
            with pytest.raises(StoreUnavailable, match="no such socket file"):
                u.exists(NS, KEYS[:1])  # an explicit unix:// URL keeps its path
            assert u.transport == "unix"
    finally:
        stop(proc)


def test_restart_on_the_same_socket_stays_on_it(tmp_path):
    port, sock = free_port(), str(tmp_path / "kv.sock")
    proc = start(port, sock)
    try:
        with KVStoreClient(f"http://127.0.0.1:{port}", timeout_s=5.0) as c:
            assert c.put_chunks(NS, KEYS[:1], [chunk(0)]) == 1 and c.transport == "unix"
            before = c.stats()["instance"]
            stop(proc)
            proc = start(port, sock)
            put_until_it_works(c, 1, within_s=WITHIN_S)
            after = c.stats()
            assert c.transport == "unix" and after["instance"] != before
            assert after["tiers"]["cpu"]["num_chunks"] == 1  # the new daemon's arena
            assert torch.equal(c.get_chunks(NS, KEYS[1:2])[0], chunk(1))
    finally:
        stop(proc)


def test_another_daemon_on_the_old_socket_path_is_left_for_http(tmp_path):
    """The URL's daemon restarts without a socket while another daemon takes the old socket
    path: the client notices the other daemon start (``hello``'s instance) and goes to the
    URL's daemon over HTTP; the other daemon gets at most the one call that found it."""
    port, sock = free_port(), str(tmp_path / "kv.sock")
    proc, other = start(port, sock), None
    try:
        with KVStoreClient(f"http://127.0.0.1:{port}", timeout_s=5.0) as c:
            assert c.put_chunks(NS, KEYS[:1], [chunk(0)]) == 1 and c.transport == "unix"
            stop(proc)
            other = start(free_port(), sock)
            proc = start(port, None)
            t0 = time.monotonic()
            while c.transport == "unix":
                assert time.monotonic() - t0 < WITHIN_S, "the client stayed on the socket"
                c.exists(NS, KEYS[:1])
                time.sleep(0.1)
            assert c.put_chunks(NS, KEYS[1:3], [chunk(1), chunk(2)]) == 2
            assert c.stats()["tiers"]["cpu"]["num_chunks"] == 2  # the URL's daemon
            with KVStoreClient("unix://" + sock, timeout_s=5.0) as o:
                assert o.exists(NS, KEYS[1:3]) == [False, False]  # none went to the other
    finally:
        stop(proc)
        if other is not None:
            stop(other)


def test_rediscovery_is_rate_limited(tmp_path, monkeypatch):
    """While the daemon offers nothing new, a failing socket asks HTTP at most once per
    ``REDISCOVER_S`` (2 s): calls fail fast in between, they do not each ask again."""
    port, sock = free_port(), str(tmp_path / "kv.sock")
    proc = start(port, sock)
    asked = []
    orig = KVStoreClient._discover

    def spy(self, timeout_s):
        asked.append(time.monotonic())
        return orig(self, timeout_s)
    monkeypatch.setattr(KVStoreClient, "_discover", spy)
    try:
        with KVStoreClient(f"http://127.0.0.1:{port}", timeout_s=5.0) as c:
            assert c.exists(NS, KEYS[:1]) == [False] and c.transport == "unix"
            assert len(asked) == 1
            stop(proc)  # down: HTTP refuses too
            for _ in range(5):
                with pytest.raises(StoreUnavailable):
                    c.exists(NS, KEYS[:1])
            assert len(asked) == 2  # one re-discovery for 5 failing calls
            assert c.transport == "unix"  # nothing answered: the path is unchanged
    finally:
        stop(proc)


def held() -> tuple[int, int, int]:
    """This process's open file descriptors, threads and memfd mappings (arenas, staging)."""
    with open("/proc/self/maps") as f:
        maps = f.read().count("memfd:")
    return len(os.listdir("/proc/self/fd")), threading.active_count(), maps


def test_switches_keep_no_old_socket_clients(tmp_path, caplog):
    """A daemon restarted again and again on alternating socket paths: each switch closes the
    client of the old socket (its connections, its release flusher thread, its mapping of
    the old daemon's arena), so a long-lived client holds what one socket client holds."""
    caplog.set_level(logging.ERROR, logger="kvstore")  # kept records hold errors' frames
    port, a, b = free_port(), str(tmp_path / "a.sock"), str(tmp_path / "b.sock")
    proc = start(port, a)
    try:
        with KVStoreClient(f"http://127.0.0.1:{port}", timeout_s=5.0) as c:
            assert c.put_chunks(NS, KEYS[:1], [chunk(0)]) == 1 and c.transport == "unix"
            assert torch.equal(c.get_chunks(NS, KEYS[:1])[0], chunk(0))  # a deferred release
            gc.collect()  # what earlier tests left behind is not counted
            before, old = held(), c._shm
            for i in range(4):
                stop(proc)
                proc = start(port, b if i % 2 == 0 else a)
                put_until_it_works(c, i % 3 + 1, within_s=WITHIN_S)
                assert c._shm.path == (b if i % 2 == 0 else a)
                assert torch.equal(c.get_chunks(NS, KEYS[i % 3 + 1:i % 3 + 2])[0],
                                   chunk(i % 3 + 1))
                gc.collect()
                assert old._closed and c._retired == []  # the replaced client is closed
                old = c._shm
            assert held() == before  # not one fd, thread or mapping more per restart
    finally:
        stop(proc)


def test_switch_under_many_threads_closes_the_old_client_after_its_last_call(tmp_path):
    """Threads calling while the daemon moves to another socket path: no call fails on a
    socket client closed under it (only ``StoreUnavailable`` while the daemon is down),
    every thread ends on the new socket, and the old client is closed once."""
    port, a, b = free_port(), str(tmp_path / "a.sock"), str(tmp_path / "b.sock")
    proc = start(port, a)
    errors: list[BaseException] = []
    stop_at = [float("inf")]
    try:
        with KVStoreClient(f"http://127.0.0.1:{port}", timeout_s=5.0) as c:
            assert c.put_chunks(NS, KEYS[:1], [chunk(0)]) == 1 and c.transport == "unix"
            old = c._shm

            def work() -> None:
                while time.monotonic() < stop_at[0]:
                    try:
                        c.exists(NS, KEYS[:1])
                        c.get_chunks(NS, KEYS[:1])
                    except StoreUnavailable:
                        time.sleep(0.01)
                    except BaseException as e:  # noqa: BLE001 - the test reports it
                        errors.append(e)
                        return
            threads = [threading.Thread(target=work) for _ in range(8)]
            for t in threads:
                t.start()
            time.sleep(0.3)
            stop(proc)
            proc = start(port, b)
            put_until_it_works(c, 0, within_s=WITHIN_S)
            stop_at[0] = time.monotonic() + 0.5
            for t in threads:
                t.join(30)
            assert errors == []
            assert c._shm.path == b and old._closed and c._retired == [] and c._uses == {}
    finally:
        stop_at[0] = 0.0
        stop(proc)


def test_back_on_the_socket_once_the_daemon_offers_one_again(tmp_path, monkeypatch):
    """Re-discovery left the client on HTTP (the daemon restarted without its socket, or was
    asked before its socket listened); restarted with a socket, the daemon is asked again
    (every ``RECHECK_HTTP_S``) and the client goes back to the socket."""
    import kvstore.daemon.client_paths as paths_mod
    monkeypatch.setattr(paths_mod, "RECHECK_HTTP_S", 0.5)
    port, sock = free_port(), str(tmp_path / "kv.sock")
    proc = start(port, sock)
    try:
        with KVStoreClient(f"http://127.0.0.1:{port}", timeout_s=5.0) as c:
            assert c.put_chunks(NS, KEYS[:1], [chunk(0)]) == 1 and c.transport == "unix"
            stop(proc)
            proc = start(port, None)
            put_until_it_works(c, 1, within_s=WITHIN_S)
            assert c.transport == "http"
            stop(proc)
            proc = start(port, sock)
            t0 = time.monotonic()
            while c.transport != "unix":
                assert time.monotonic() - t0 < WITHIN_S, "the client stayed on HTTP"
                try:
                    c.exists(NS, KEYS[:1])
                except StoreUnavailable:
                    pass
                time.sleep(0.1)
            assert c._shm.path == sock
            assert c.put_chunks(NS, KEYS[2:3], [chunk(2)]) == 1
            assert torch.equal(c.get_chunks(NS, KEYS[2:3])[0], chunk(2))
            assert c.stats()["instance"] == c._instance
    finally:
        stop(proc)
