"""``StoreConfig``'s codec settings that would do nothing: a ``remote_codec`` other than ``raw``
without ``remote_url`` is refused (as ``kvstore serve`` refuses remote-tier settings without a
remote URL), a ``disk_codec`` other than ``auto`` without a disk tier is logged; and
``tier_codecs()`` names the codec of each present lower tier."""
import logging

import pytest

from kvstore.config import StoreConfig
from kvstore.daemon.config import ServeConfig


@pytest.mark.parametrize("codec", ["zstd", "lz4", "kivi"])
def test_remote_codec_without_remote_url_is_refused(codec):
    with pytest.raises(ValueError, match=f"remote-tier settings without a remote URL "
                                         f"\\(remote_url\\): remote_codec='{codec}'"):
        StoreConfig(cpu_bytes="1MiB", remote_codec=codec)


def test_default_remote_codec_without_url_and_any_codec_with_url_are_accepted():
    assert StoreConfig(cpu_bytes="1MiB").remote_codec == "raw"
    cfg = StoreConfig(cpu_bytes="1MiB", remote_url="redis://h:1", remote_codec="kivi")
    assert cfg.tier_codecs() == {"remote": "kivi"}
    with pytest.raises(ValueError, match="unknown remote_codec 'zstd'"):   # still named
        StoreConfig(cpu_bytes="1MiB", remote_url="redis://h:1", remote_codec="zstd")


def test_disk_codec_without_disk_tier_logs_one_warning(caplog, tmp_path):
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        cfg = StoreConfig(cpu_bytes="1MiB", disk_codec="kivi")
    assert [r.getMessage() for r in caplog.records] == [
        "disk_codec kivi has no effect without a disk tier (disk_bytes and disk_path)"]
    assert cfg.tier_codecs() == {}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        StoreConfig(cpu_bytes="1MiB")                                  # auto: nothing said
        with_disk = StoreConfig(cpu_bytes="1MiB", disk_bytes="8MiB",
                                disk_path=str(tmp_path / "d"), disk_codec="kivi")
    assert caplog.records == []
    assert with_disk.tier_codecs() == {"disk": "kivi"}


def test_daemon_without_disk_tier_passes_no_disk_codec_to_the_store(caplog):
    """``kvstore serve --disk-codec int8`` without ``--disk-path`` warns once, at start
    (``start_checks``): the store's config gets ``auto``, so it does not warn again."""
    kw = ServeConfig(cpu_bytes="64MiB", disk_codec="int8").store_config_kwargs()
    assert kw["disk_codec"] == "auto"
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        StoreConfig(**kw)
    assert caplog.records == []
