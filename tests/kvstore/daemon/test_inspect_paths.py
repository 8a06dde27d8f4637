"""``kvstore inspect`` takes a disk tier's directory or its ``data.mdb`` (it said "holds no disk
tier (no data.mdb)" for the file), names the directory for another file, says a missing path
does not exist, and refuses a negative ``--limit`` (exit 2, one line; it listed nothing). A
real disk tier written by a ChunkStore."""
from __future__ import annotations

import json

import pytest

from kvstore.daemon import cli
from kvstore.disk_inspect import inspect_disk
from tests.kvstore.daemon.server_helpers import KEYS, NS, chunk, make_store


@pytest.fixture
def disk(tmp_path):
    store = make_store(str(tmp_path / "disk"))
    assert store.put_chunks(NS, KEYS[:3], [chunk(i) for i in range(3)]) == 3
    store.close(persist_s=10)  # the CPU tier's chunks to the disk tier
    return tmp_path / "disk"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["inspect", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_data_mdb_reads_as_its_directory(disk, capsys):
    rc, out, err = run(capsys, str(disk / "data.mdb"), "--json")
    by_file = json.loads(out)
    assert (rc, err) == (0, "")
    rc, out, _ = run(capsys, str(disk), "--json")
    assert rc == 0 and json.loads(out) == by_file
    assert by_file["num_chunks"] == 3 and by_file["path"] == str(disk.resolve())


def test_another_file_names_the_directory(disk, capsys):
    rc, out, err = run(capsys, str(disk / "lock.mdb"))
    assert (rc, out) == (2, "")
    assert err == (f"kvstore inspect: {str(disk / 'lock.mdb')!r} is a file; pass the disk "
                   f"tier's directory (the one holding data.mdb, as given to --disk-path)\n")


def test_a_missing_path_is_named_as_missing_not_as_an_empty_tier(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    rc, out, err = run(capsys, missing)
    assert (rc, out) == (2, "")
    assert err == (f"kvstore inspect: {missing!r} does not exist (give the disk tier's "
                   f"directory, as given to --disk-path)\n")
    rc, _, err = run(capsys, str(tmp_path))              # exists, holds no tier
    assert rc == 2
    assert err == f"kvstore inspect: {str(tmp_path)!r} holds no disk tier (no data.mdb)\n"


def test_a_negative_limit_is_refused_and_zero_lists_all(disk, capsys):
    rc, out, err = run(capsys, str(disk), "--limit", "-1")
    assert (rc, out) == (2, "")
    assert err == "kvstore inspect: error: --limit must be >= 0 (0 lists every chunk), got -1\n"
    with pytest.raises(ValueError, match="limit must be an int >= 0"):
        inspect_disk(str(disk), limit=-1)
    assert len(inspect_disk(str(disk), limit=0)["chunks"]) == 3
    assert len(inspect_disk(str(disk), limit=1)["chunks"]) == 1
