"""``KVSTORE_*`` variables of ``kvstore serve``: each is parsed to its setting's type, and one
that cannot be parsed is refused naming the variable and its value (exit 2, one ``error:`` line),
before any tier is built."""
import os

import pytest

from kvstore.daemon import cli
from kvstore.daemon import config as serve_config
from kvstore.daemon.config_env import EnvValueError


def test_good_values_are_parsed_to_their_types():
    env = {"KVSTORE_CPU_BYTES": "2MiB", "KVSTORE_PORT": "8601", "KVSTORE_INSECURE": "yes",
           "KVSTORE_REMOTE_TTL_S": "1.5", "KVSTORE_MAX_CONNECTIONS": "auto",
           "KVSTORE_LOG_LEVEL": "DEBUG", "KVSTORE_DEVICE": "cuda:1"}
    assert serve_config.from_env(env) == {
        "cpu_bytes": 2 << 20, "port": 8601, "insecure": True, "remote_ttl_s": 1.5,
        "max_connections": "auto", "log_level": "DEBUG", "device": "cuda:1"}
    cfg = serve_config.resolve({}, {**env, "KVSTORE_REMOTE_URL": "redis://127.0.0.1:1"})
    assert (cfg.cpu_bytes, cfg.port, cfg.insecure, cfg.remote_ttl_s) == (2 << 20, 8601, True, 1.5)


@pytest.mark.parametrize("var, value, reason", [
    ("KVSTORE_CPU_BYTES", "12XB", "unknown size unit 'XB' in '12XB'"),
    ("KVSTORE_PORT", "85OO", "not a whole number"),
    ("KVSTORE_REQUEST_TIMEOUT_S", "10s", "not a number"),
    ("KVSTORE_INSECURE", "maybe", "not a boolean: 'maybe'"),
    ("KVSTORE_POLICY", "mru", "choose one of arc, fifo, lfu, lru, s3fifo"),
])
def test_a_value_that_cannot_be_parsed_names_the_variable(var, value, reason):
    with pytest.raises(EnvValueError) as exc:
        serve_config.resolve({}, {var: value})
    assert str(exc.value).startswith(f"{var}={value!r}: {reason}")


def test_two_bad_variables_are_both_named_in_one_line():
    with pytest.raises(EnvValueError) as exc:
        serve_config.resolve({}, {"KVSTORE_PORT": "80a", "KVSTORE_CPU_BYTES": "12XB",
                                  "KVSTORE_GPU_BYTES": "0"})
    first, second = str(exc.value).split(" | ")
    assert first.startswith("KVSTORE_CPU_BYTES='12XB': unknown size unit 'XB'")
    assert second == "KVSTORE_PORT='80a': not a whole number"


@pytest.mark.parametrize("env, line", [
    ({"KVSTORE_CPU_BYTES": "12XB"},
     "kvstore serve: error: KVSTORE_CPU_BYTES='12XB': unknown size unit 'XB' in '12XB'; use "
     "one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, K, M, G, T"),
    ({"KVSTORE_MAX_BATCH_KEYS": "1e3"},
     "kvstore serve: error: KVSTORE_MAX_BATCH_KEYS='1e3': not a whole number"),
])
def test_kvstore_serve_exits_2_with_one_error_line(monkeypatch, capsys, env, line):
    for name in [n for n in os.environ if n.startswith("KVSTORE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["serve", "--port", "0"]) == 2
    out = capsys.readouterr()
    assert out.err.splitlines() == [line] and out.out == ""


def test_a_config_value_that_is_not_a_number_names_its_setting():
    from kvstore.daemon.config import ServeConfig
    for field, value, want in (("port", "abc", "port 'abc' is not an int"),
                               ("max_batch_keys", 1.5, "max_batch_keys 1.5 is not an int"),
                               ("request_timeout_s", "soon", "request_timeout_s 'soon' is not a number"),
                               ("max_connections", "many", "max_connections 'many' is not an int")):
        with pytest.raises(ValueError) as e:
            ServeConfig(**{field: value})
        assert str(e.value) == want


def test_start_warnings_name_a_tier_smaller_than_a_real_chunk_and_a_disk_beyond_free_space(tmp_path):
    import shutil
    from kvstore.daemon.config import ServeConfig
    from kvstore.daemon.start_checks import SMALLEST_REAL_CHUNK_BYTES, tier_warnings
    assert SMALLEST_REAL_CHUNK_BYTES == 5_898_240
    assert tier_warnings(ServeConfig(cpu_bytes="64MiB")) == []
    w = tier_warnings(ServeConfig(cpu_bytes="64MiB", disk_path=str(tmp_path / "d"),
                                  disk_bytes="1KiB"))
    assert len(w) == 1 and w[0].startswith("the disk tier (1KiB, --disk-bytes) is smaller")
    free = shutil.disk_usage(tmp_path).free
    w = tier_warnings(ServeConfig(cpu_bytes="4MiB", disk_path=str(tmp_path / "new" / "d"),
                                  disk_bytes=free + (1 << 30)))
    assert len(w) == 2 and w[0].startswith("the cpu tier (4MiB")
    assert "larger than the" in w[1] and "free at" in w[1]


def test_start_warnings_name_settings_that_have_no_effect(tmp_path, capsys):
    from kvstore.daemon.config import ServeConfig
    from kvstore.daemon.start_checks import start_warnings, unused_setting_warnings
    assert unused_setting_warnings(ServeConfig(cpu_bytes="64MiB")) == []
    assert unused_setting_warnings(ServeConfig(
        cpu_bytes="64MiB", disk_path=str(tmp_path / "d"), disk_codec="int8",
        remote_url="redis://127.0.0.1:1", remote_codec="kivi")) == []  # each has its tier
    cfg = ServeConfig(cpu_bytes="64MiB", disk_codec="int8", remote_codec="kivi",
                      auth_token="t" * 20, tenants_file=str(tmp_path / "tenants.yaml"))
    assert start_warnings(cfg) == [
        "--disk-codec int8 has no effect without a disk tier (--disk-path)",
        "--remote-codec kivi has no effect without a remote tier (--remote-url)",
        "--auth-token and --tenants-file are both set: neither replaces the other; the token "
        "is one more admin (tenant 'admin', every namespace) beside the file's tenants"]
    # what the last one says: both authenticate, the token as the admin 'admin'
    from kvstore.daemon.state import ServerLimits, tenant_table
    from kvstore.daemon.tenants import TenantTable
    file_tenants = TenantTable.from_mapping({"alice": {"token": "a" * 20, "role": "tenant"}})
    both = tenant_table(ServerLimits(auth_token="t" * 20, tenants=file_tenants))
    assert both.authenticate("Bearer " + "a" * 20).name == "alice"
    who = both.authenticate("Bearer " + "t" * 20)
    assert (who.name, who.role, who.salt) == ("admin", "admin", None)


def test_a_size_that_does_not_parse_names_its_setting():
    from kvstore.daemon.config import ServeConfig
    with pytest.raises(ValueError) as e:
        ServeConfig(cpu_bytes="lots")
    assert str(e.value).startswith("cpu_bytes: not a byte size: 'lots'")
    with pytest.raises(ValueError, match="^max_inflight_bytes: "):
        ServeConfig(max_inflight_bytes="-1")
