"""The daemon's HTTP routes, in process: every operation, every bad input, the server stays up.

The server runs on a private loop thread (``ThreadedServer``) over a real ``ChunkStore``; raw
requests go through ``http.client`` / sockets so malformed input reaches the server unaltered.
"""
import json
import socket
import threading
import time

import torch

from kvstore.daemon import protocol as P
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app

from tests.kvstore.daemon.server_helpers import (
    KEYS, LAYOUT, NS, OTHER, TOKEN, chunk, do_get, do_put, make_store, post_json, put_body,
    request, stored,
)
from tests.kvstore.daemon.server_helpers import _clean, server  # noqa: F401  (fixtures)


def test_put_then_get_is_bit_exact_and_lookup_counts_leading_chunks(server):
    kvs = [chunk(i) for i in range(3)]
    status, ans = do_put(server, put_body(KEYS[:3], kvs))
    assert (status, ans) == (200, {"stored": 3, "num_chunks": 3, "durable": False,
                                   "already_stored": 0, "refused": 0, "first_refused": None})
    assert do_put(server, put_body(KEYS[:3], kvs))[1]["stored"] == 0  # present keys skipped
    status, got = do_get(server, [KEYS[0], KEYS[4], KEYS[2]])
    assert status == 200
    assert torch.equal(got[0], kvs[0]) and got[1] is None and torch.equal(got[2], kvs[2])
    status, res = post_json(server, "/v1/lookup", {"namespace": NS.to_dict(),
                                                   "keys": [k.hex() for k in KEYS]})
    assert status == 200
    assert res == {"num_hit_chunks": 3, "chunk_size": 4, "tiers": ["cpu"] * 3,
                   "num_requested_chunks": 6}
    assert stored(server, KEYS[2:5]) == [True, False, False]


def test_missing_keys_get_404_never_an_empty_200(server):
    status, ans = do_get(server, KEYS[:2])
    assert status == 404
    assert ans == {"error": "none of the 2 keys is stored", "status": 404}


def test_get_of_no_keys_is_400_and_other_routes_answer_empty_batches_trivially(server):
    status, ans = do_get(server, [])
    assert (status, ans) == (400, {"error": "'keys' must be a non-empty list", "status": 400})
    body = {"namespace": NS.to_dict(), "keys": []}
    assert post_json(server, "/v1/lookup", body) == (200, {
        "num_hit_chunks": 0, "chunk_size": 4, "tiers": [], "num_requested_chunks": 0})
    assert post_json(server, "/v1/exists", body) == (200, {"exists": []})
    assert post_json(server, "/v1/remove", body) == (200, {"removed": 0})
    status, ans = do_put(server, P.put_header(NS, []))
    assert (status, ans["error"]) == (400, "'chunks' must be a non-empty list")


def test_remove_and_clear_per_namespace(server):
    assert do_put(server, put_body(KEYS[:2], [chunk(0), chunk(1)]))[0] == 200
    other_keys = OTHER.chunk_keys(list(range(8)))
    assert do_put(server, put_body(other_keys, [chunk(2), chunk(3)], ns=OTHER))[0] == 200
    assert post_json(server, "/v1/remove", {"namespace": NS.to_dict(),
                                            "keys": [KEYS[0].hex(), KEYS[5].hex()]}) \
        == (200, {"removed": 1})
    assert post_json(server, "/v1/clear", {"namespace": OTHER.to_dict()}) == (200, {"removed": 2})
    assert stored(server, KEYS[:2]) == [False, True]
    assert stored(server, other_keys, ns=OTHER) == [False, False]
    assert post_json(server, "/v1/clear", {"all": True}) == (200, {"removed": 1})


def test_a_clear_naming_two_targets_clears_nothing(server):
    """``{"namespace", "ns_id"}`` or ``{"all", ...}``: which was meant cannot be told."""
    assert do_put(server, put_body(KEYS[:2], [chunk(0), chunk(1)]))[0] == 200
    for body in ({"namespace": NS.to_dict(), "ns_id": OTHER.ns_id.hex()},
                 {"all": True, "namespace": OTHER.to_dict()},
                 {"all": True, "ns_id": NS.ns_id.hex()}):
        status, ans = post_json(server, "/v1/clear", body)
        assert status == 400 and "clear takes one of namespace, ns_id or all" in ans["error"]
    assert stored(server, KEYS[:2]) == [True, True]


def test_a_clear_all_that_is_not_true_is_named_and_clears_nothing(server):
    assert do_put(server, put_body(KEYS[:2], [chunk(0), chunk(1)]))[0] == 200
    for value, shown in (("yes", "'yes'"), (1, "'1'"), (False, "'False'")):
        status, ans = post_json(server, "/v1/clear", {"all": value})
        assert status == 400, (value, ans)
        assert ans["error"] == ("'all' must be true (the JSON boolean) to clear every "
                                f"namespace, got {shown}"), ans
    assert stored(server, KEYS[:2]) == [True, True]


def test_tenants_cannot_name_each_others_keys(server):
    assert do_put(server, put_body(KEYS[:1], [chunk(0)]))[0] == 200
    status, ans = post_json(server, "/v1/exists", {"namespace": OTHER.to_dict(),
                                                   "keys": [KEYS[0].hex()]})
    assert status == 400 and "does not belong" in ans["error"]
    status, ans = do_put(server, put_body(KEYS[1:2], [chunk(1)], ns=OTHER))
    assert status == 400 and "does not belong" in ans["error"]


def test_malformed_json_and_framing_get_400_json_errors(server):
    status, data, _ = request(server, "POST", "/v1/lookup", b"{nope",
                              {"Content-Type": "application/json"})
    assert status == 400 and json.loads(data)["error"].startswith("malformed JSON in request")
    status, ans = do_put(server, b"GARBAGE!" + b"x" * 40)
    assert status == 400 and ans["error"].startswith("bad magic")
    status, ans = do_put(server, put_body(KEYS[:1], [chunk(0)])[:-10])  # short payload
    assert status == 400 and ans["error"] == "body is 657 bytes but its header declares 667"
    status, ans = post_json(server, "/v1/lookup", {"namespace": {"model_id": "x"}, "keys": []})
    assert status == 400 and ans["error"].startswith("bad namespace")
    status, data, _ = request(server, "POST", "/v1/exists", P.key_request(NS, KEYS[:1]),
                              {P.VERSION_HEADER: "9"})
    assert status == 400 and "unsupported protocol version 9" in json.loads(data)["error"]


def test_empty_wrongly_sized_and_oversized_bodies(server):
    status, ans = do_put(server, b"")
    assert (status, ans["error"]) == (400, "empty put body")
    status, ans = do_put(server, put_body(KEYS[:1], [chunk(0)]) + b"extra")
    assert status == 400 and "declares" in ans["error"]
    big = torch.zeros(LAYOUT.shape(), dtype=torch.float32)  # 2x the bytes the layout allows
    entry, view = P.entry_for(KEYS[0], big)
    status, ans = do_put(server, P.put_header(NS, [entry]) + bytes(view))
    assert status == 400 and ans["error"].startswith("dtype mismatch")
    status, ans = do_put(server, put_body(KEYS[:6], [chunk(i) for i in range(6)]) + b"x" * 4096)
    assert status == 413 and "exceeds 4096" in ans["error"]
    status, ans = post_json(server, "/v1/exists", {"namespace": NS.to_dict(),
                                                   "keys": [KEYS[0].hex()] * 9})
    assert status == 413 and "limit of 8" in ans["error"]
    assert stored(server, KEYS) == [False] * 6


def test_wrong_or_missing_token_gets_401_but_health_is_open(server):
    status, data, _ = request(server, "GET", "/v1/stats", auth=False)
    assert status == 401 and json.loads(data)["error"] == "missing or wrong bearer token"
    status, data, _ = request(server, "GET", "/v1/stats", headers={"Authorization": "Bearer x"},
                              auth=False)
    assert status == 401
    status, ans = do_put(server, put_body(KEYS[:1], [chunk(0)]),
                         auth=False)
    assert status == 401 and stored(server, KEYS[:1]) == [False]
    assert request(server, "GET", "/healthz", auth=False)[0] == 200
    assert request(server, "GET", "/readyz", auth=False)[0] == 200
    status, data, _ = request(server, "GET", "/metrics", auth=False)  # metrics need it too
    assert status == 401 and json.loads(data)["error"] == "missing or wrong bearer token"
    status, data, _ = request(server, "GET", "/metrics")
    assert status == 200 and b"kvstore_server_requests_total" in data


def test_checksum_mismatch_is_400_and_nothing_of_the_batch_is_stored(server):
    status, ans = do_put(server, put_body(KEYS[:3], [chunk(i) for i in range(3)], corrupt=2))
    assert status == 400 and ans["error"].startswith("checksum mismatch for key")
    assert stored(server, KEYS[:3]) == [False, False, False]
    assert server.store.tiers[0].used_bytes == 0  # the reserved pages went back
    server.store.check_integrity()


def test_client_disconnecting_mid_upload_leaves_nothing_visible(server):
    body = put_body(KEYS[:4], [chunk(i) for i in range(4)])
    with socket.create_connection((server.host, server.port)) as s:
        s.sendall(f"POST /v1/put HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:len(body) - 300])
        time.sleep(0.2)
    time.sleep(0.2)
    assert stored(server, KEYS[:4]) == [False] * 4
    assert server.store.tiers[0].used_bytes == 0  # the reserved pages went back
    server.store.check_integrity()


def test_two_concurrent_puts_of_one_key_leave_exactly_one_complete_value(server):
    a, b = chunk(10), chunk(11)
    results = []
    threads = [threading.Thread(target=lambda kv=kv: results.append(
        do_put(server, put_body(KEYS[:1], [kv])))) for kv in (a, b) * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s == 200 for s, _ in results)
    assert sum(ans["stored"] for _, ans in results) == 1
    status, got = do_get(server, KEYS[:1])
    assert torch.equal(got[0], a) or torch.equal(got[0], b)


def test_pins_hold_leases_capped_by_the_server_and_expire_when_the_client_vanishes(server):
    assert do_put(server, put_body(KEYS[:2], [chunk(0), chunk(1)]))[0] == 200
    status, ans = post_json(server, "/v1/pin", {"namespace": NS.to_dict(),
                                                "keys": [KEYS[0].hex(), KEYS[3].hex()]})
    assert (status, ans) == (200, {"pinned": 1, "lease_s": 1.0})  # capped at max_lease_s
    status, ans = post_json(server, "/v1/pin", {"namespace": NS.to_dict(),
                                                "keys": [KEYS[1].hex()], "lease_s": 0.2})
    assert (status, ans) == (200, {"pinned": 1, "lease_s": 0.2})
    assert [server.store.pin_count(k) for k in KEYS[:2]] == [1, 1]
    assert post_json(server, "/v1/unpin", {"namespace": NS.to_dict(),
                                           "keys": [KEYS[0].hex()]}) == (200, {"unpinned": 1})
    time.sleep(0.3)  # the pinning client is gone; its lease runs out
    assert [server.store.pin_count(k) for k in KEYS[:2]] == [0, 0]
    status, ans = post_json(server, "/v1/pin", {"namespace": NS.to_dict(),
                                                "keys": [KEYS[1].hex()], "lease_s": -1})
    assert status == 400 and "lease_s must be a positive number" in ans["error"]


def test_nan_or_boolean_lease_is_400_and_pins_nothing(server):
    assert do_put(server, put_body(KEYS[:1], [chunk(0)]))[0] == 200
    for lease in (float("nan"), True):  # json.dumps writes NaN, which the server's parser reads
        status, ans = post_json(server, "/v1/pin", {"namespace": NS.to_dict(),
                                                    "keys": [KEYS[0].hex()], "lease_s": lease})
        assert status == 400 and "lease_s must be a positive number" in ans["error"]
    assert server.store.pin_count(KEYS[0]) == 0


def test_namespace_whose_chunk_exceeds_every_tier_is_400_not_500(server):
    big = Namespace("tiny-model", KVLayout(num_layers=100_000, num_kv_heads=1, head_dim=8,
                                           dtype="float16", chunk_size=4))  # 12.8 MB > 1 MiB tier
    keys = big.chunk_keys(list(range(4)))
    for path in ("/v1/lookup", "/v1/get", "/v1/exists", "/v1/pin"):
        status, ans = post_json(server, path, {"namespace": big.to_dict(),
                                               "keys": [k.hex() for k in keys]})
        assert status == 400, (path, status, ans)
        assert "smaller than one chunk" in ans["error"]
    e = P.ChunkEntry(keys[0], big.layout.chunk_bytes, "float16", big.layout.shape(), "0" * 16)
    status, ans = do_put(server, P.put_header(big, [e]))  # refused before any payload is read
    assert status == 400 and "smaller than one chunk" in ans["error"]


def test_durable_put_is_committed_to_the_disk_tier_before_the_answer(server):
    kvs = [chunk(20), chunk(21)]
    status, ans = do_put(server, put_body(KEYS[:2], kvs, durable=True))
    assert (status, ans) == (200, {"stored": 2, "num_chunks": 2, "durable": True,
                                   "already_stored": 0, "refused": 0, "first_refused": None})
    disk = server.store.tiers[-1]
    assert disk.name == "disk" and all(disk.contains(k) and not disk.is_pending(k)
                                       for k in KEYS[:2])
    assert torch.equal(disk.read(KEYS[1]), kvs[1])


def test_durable_put_without_a_disk_tier_is_refused_and_nothing_stored():
    store = make_store()
    with ThreadedServer(create_app(store, ServerLimits(auth_token=TOKEN))) as srv:
        status, ans = do_put(srv, put_body(KEYS[:1], [chunk(0)], durable=True))
        assert status == 400 and ans["error"].startswith("durable put needs a disk tier")
        assert stored(srv, KEYS[:1]) == [False]
    store.close()


def test_stats_metrics_and_unknown_routes(server):
    do_put(server, put_body(KEYS[:2], [chunk(0), chunk(1)]))
    post_json(server, "/v1/lookup", {"namespace": NS.to_dict(), "keys": [KEYS[0].hex()]})
    status, data, _ = request(server, "GET", "/v1/stats")
    st = json.loads(data)
    assert status == 200 and st["server"]["protocol_version"] == 1
    assert st["server"]["max_batch_keys"] == 8
    status, data, resp = request(server, "GET", "/metrics")
    text = data.decode()
    assert status == 200 and resp.getheader("Content-Type").startswith("text/plain")
    assert 'kvstore_server_requests_total{route="/v1/put",status="200"}' in text
    assert "kvstore_server_request_duration_seconds_bucket" in text
    assert "\nkvstore_lookups_total " in text and 'kvstore_capacity_bytes{tier="cpu"} 1.048576e+06' in text
    status, data, _ = request(server, "GET", "/nope")
    assert status == 404 and json.loads(data)["status"] == 404
    status, data, _ = request(server, "GET", "/v1/put")
    assert status == 405 and json.loads(data)["status"] == 405
