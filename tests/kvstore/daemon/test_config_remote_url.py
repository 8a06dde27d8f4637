"""``kvstore serve`` refuses remote-tier settings given without a remote URL (they would be
ignored silently: no remote tier is built), from a flag, a ``KVSTORE_*`` variable or the
config file alike: exit 2, one line naming each; a remote password alone is only warned about
(it may be set for a whole fleet)."""
import logging
import os

import pytest

from kvstore.daemon import cli
from kvstore.daemon import config as serve_config
from kvstore.daemon.config_env import remote_without_url


@pytest.fixture
def clean_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("KVSTORE_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_remote_without_url_names_each_setting_as_given():
    assert remote_without_url({"remote_codec": "kivi"}, {"remote_ttl_s": 2.0},
                              {"remote_key_prefix": "a:b"}) == (
        ["remote_codec (config file)", "KVSTORE_REMOTE_TTL_S", "--remote-key-prefix"], False)
    assert remote_without_url({}, {"remote_password": "pw"}, {}) == ([], True)
    assert remote_without_url({}, {}, {"remote_url": ""}) == ([], False)
    # any layer's URL makes them meaningful, even one that a layer above empties
    assert remote_without_url({"remote_url": "redis://h:1", "remote_codec": "kivi"},
                              {"remote_url": ""}, {"remote_ttl_s": 1.0}) == ([], False)


def test_serve_refuses_a_remote_flag_without_a_url_in_one_line(clean_env, capsys):
    assert cli.main(["serve", "--port", "0", "--remote-key-prefix", "a:b"]) == 2
    out = capsys.readouterr()
    assert out.err.splitlines() == [
        "kvstore serve: remote-tier settings without a remote URL (--remote-url, "
        "KVSTORE_REMOTE_URL or remote_url): --remote-key-prefix"] and out.out == ""


def test_env_and_file_remote_settings_without_a_url_are_refused(clean_env, tmp_path):
    conf = tmp_path / "serve.yaml"
    conf.write_text("remote_codec: kivi\nremote-queue-bytes: 1MiB\n")
    clean_env.setenv("KVSTORE_REMOTE_TIMEOUT_S", "0.5")
    with pytest.raises(ValueError) as err:
        serve_config.resolve({"remote_ttl_s": 3.0, "remote_url": None}, config_file=str(conf))
    assert str(err.value).endswith(": remote_queue_bytes (config file), remote_codec (config "
                                   "file), KVSTORE_REMOTE_TIMEOUT_S, --remote-ttl-s")
    cfg = serve_config.resolve({"remote_url": "redis://127.0.0.1:1", "remote_ttl_s": 3.0},
                               config_file=str(conf))
    assert (cfg.remote_codec, cfg.remote_queue_bytes, cfg.remote_timeout_s,
            cfg.remote_ttl_s) == ("kivi", 1 << 20, 0.5, 3.0)


def test_a_remote_password_without_a_url_is_one_warning(clean_env, caplog):
    clean_env.setenv("KVSTORE_REMOTE_PASSWORD", "secret")
    with caplog.at_level(logging.WARNING, logger="kvstore.daemon.config"):
        cfg = serve_config.resolve({"port": 0})
    assert cfg.remote_url is None
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["remote password (KVSTORE_REMOTE_PASSWORD or remote_password) set but no "
                      "remote URL: ignored, no remote tier"]
    assert "secret" not in warned[0]
