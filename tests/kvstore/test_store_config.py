"""StoreConfig validation and byte-size text (kvstore.units)."""
import pytest

from kvstore.config import StoreConfig
from kvstore.layout import KVLayout
from kvstore.units import format_size, parse_size


@pytest.mark.parametrize("text,num_bytes", [
    ("8GiB", 8 * 2**30), ("8G", 8 * 2**30), ("2GB", 2 * 10**9), ("512 MiB", 512 * 2**20),
    ("1.5KiB", 1536), ("4096", 4096), (4096, 4096), ("0", 0), ("3kb", 3000), ("1TiB", 2**40)])
def test_parse_size(text, num_bytes):
    assert parse_size(text) == num_bytes


@pytest.mark.parametrize("bad,msg", [("-1", "not a byte size"), ("8XB", "unknown size unit 'XB'"),
                                     ("abc", "not a byte size"), ("0.5B", "not a whole number"),
                                     (-5, ">= 0"), (True, "not a byte size")])
def test_parse_size_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        parse_size(bad)


def test_format_size():
    assert [format_size(n) for n in (0, 1023, 1536, 8 * 2**30, 5898240)] == \
        ["0B", "1023B", "1.5KiB", "8GiB", "5.62MiB"]


def test_config_parses_and_validates(tmp_path):
    cfg = StoreConfig(gpu_bytes="6MiB", cpu_bytes="8MiB", disk_bytes="1GiB", disk_path=tmp_path)
    assert (cfg.gpu_bytes, cfg.cpu_bytes, cfg.disk_bytes, cfg.page_bytes) == (6 * 2**20, 8 * 2**20, 2**30, 4096)
    assert cfg.tiers == ("gpu", "cpu", "disk") and cfg.disk_path == str(tmp_path)
    assert StoreConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.footprint("cpu", 5898240) == 1440 * 4096 and cfg.footprint("disk", 100) == 100
    assert cfg.footprint("cpu", 4097) == 8192  # whole pages
    cfg.check_layout(KVLayout(30, 3, 64, "float16", 256))
    with pytest.raises(AttributeError):
        cfg.cpu_bytes = 1  # frozen
    for kwargs, msg in [(dict(cpu_bytes=0), "at least one tier"),
                        (dict(disk_bytes="1GiB"), "disk_bytes > 0 needs disk_path"),
                        (dict(disk_policy="random"), "unknown disk_policy 'random'"),
                        (dict(disk_codec="zstd"), "unknown disk_codec 'zstd'"),
                        (dict(page_bytes=100), "page_bytes must be a positive multiple of 64"),
                        (dict(gpu_bytes=1000), "gpu_bytes=1000 is smaller than one page"),
                        (dict(cpu_bytes="lots"), "not a byte size")]:
        with pytest.raises(ValueError, match=msg):
            StoreConfig(**kwargs)
    with pytest.raises(ValueError, match="unknown StoreConfig fields \\['cpu_gb'\\]"):
        StoreConfig.from_dict({"cpu_gb": 1})
