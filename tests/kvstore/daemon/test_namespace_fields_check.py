"""The daemon refuses a namespace's unknown fields with ``kvstore.ns_wire.check_known_fields``
itself (``kvstore.daemon.fields.check_namespace_fields``): one check and one wording for the
daemon's 400 and for every other parse of a namespace (``Namespace.from_dict``, the CLI)."""
import pytest

from kvstore.daemon.fields import ProtocolError, parse_namespace
from kvstore.keys import Namespace
from kvstore.ns_wire import check_known_fields
from tests.kvstore.daemon.server_helpers import NS


def _cases():
    d = NS.to_dict()
    many = {**d, **{f"extra_{i}": i for i in range(7)}}
    layout = {**d, "layout": {**d["layout"], "hed_dim": 8}}
    both = {**layout, "cache_slat": "x"}  # namespace fields are named first
    return [{**d, "sliding_window": 4096}, many, layout, both]


@pytest.mark.parametrize("bad", _cases())
def test_the_daemon_answers_ns_wires_message(bad):
    with pytest.raises(ValueError) as lib:
        check_known_fields(bad)
    with pytest.raises(ValueError) as from_dict:
        Namespace.from_dict(bad)
    with pytest.raises(ProtocolError) as daemon:
        parse_namespace(bad)
    assert daemon.value.status == 400
    assert str(daemon.value) == (f"bad namespace: {lib.value} (a newer client than this "
                                 "daemon?)")
    assert str(from_dict.value) == str(lib.value)  # one wording everywhere


def test_known_fields_parse():
    assert parse_namespace(NS.to_dict()).ns_id == NS.ns_id
