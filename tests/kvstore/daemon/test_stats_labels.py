"""``kvstore stats``'s table says what each traffic counter counts: ``lookups`` and their
tokens apart from ``hits``/``misses``, which count the chunks of get calls. One narrated
scenario against a live in-process daemon: 3 chunks stored, one lookup of 6 chunk keys (3 hit,
12 of 24 tokens), one get of 4 keys (3 chunks returned, 1 missed)."""
from kvstore.daemon import cli
from kvstore.daemon.client import KVStoreClient
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from tests.kvstore.daemon.server_helpers import KEYS, NS, TOKEN, chunk, make_store


def _rows(table: str) -> dict[str, str]:
    """label -> value text of each table row (the label may hold spaces: split on 2+)."""
    out = {}
    for line in table.splitlines():
        label, value = line.split("  ", 1)
        out[label.strip()] = value.strip()
    return out


def test_stats_table_labels_lookup_and_get_counters(capsys):
    store = make_store()
    try:
        with ThreadedServer(create_app(store, ServerLimits(auth_token=TOKEN))) as srv:
            with KVStoreClient(srv.url, auth_token=TOKEN) as c:
                assert c.put_chunks(NS, KEYS[:3], [chunk(i) for i in range(3)]) == 3
                assert c.lookup_keys(NS, KEYS).num_hit_chunks == 3
                got = c.get_chunks(NS, KEYS[:2] + KEYS[4:5] + KEYS[2:3])
                assert [g is not None for g in got] == [True, True, False, True]
            assert cli.main(["stats", srv.url, "--auth-token", TOKEN]) == 0
    finally:
        store.close()
    rows = _rows(capsys.readouterr().out)
    assert rows["lookups (prefix lookups)"] == "1"
    assert rows["requested_tokens (lookup: tokens asked)"] == "24"
    assert rows["hit_tokens (lookup: leading tokens found)"] == "12"
    assert rows["hits (get: chunks returned)"] == "3"
    assert rows["hits_by_tier.cpu (get: chunks returned)"] == "3"
    assert rows["misses (get: chunks not returned)"] == "1"
    assert rows["stored_chunks"] == "3"              # rows without a note keep their bare name
    assert not any(k in rows for k in ("hits", "misses", "lookups"))


def test_format_table_notes_only_where_asked():
    st = {"hits": 2, "hits_by_tier": {"disk": 2}, "remote": {"hits": 5, "reads": 6}}
    assert cli.format_table(st).splitlines() == [
        "hits               2",
        "hits_by_tier.disk  2",
        "remote.hits        5",
        "remote.reads       6"]
    assert cli.format_table(st, notes=cli.STAT_NOTES).splitlines() == [
        "hits (get: chunks returned)               2",
        "hits_by_tier.disk (get: chunks returned)  2",
        "remote.hits (get: chunks read)            5",
        "remote.reads (get: chunks asked)          6"]
