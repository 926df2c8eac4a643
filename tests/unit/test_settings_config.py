"""Settings sources and their precedence: defaults < TOML config file < environment < flags."""

from __future__ import annotations

import pytest

from services.cli import _parser, load_settings
from shared import settings as settings_mod
from shared.settings import Settings, from_env


def write(tmp_path, text: str):
    path = tmp_path / "mmfleet.toml"
    path.write_text(text)
    return path


def test_precedence_defaults_file_env_flags(tmp_path):
    cfg = write(tmp_path, 'gateway_port = 8100\nredis_url = "redis://file:1/0"\npool_bytes = 1234\n'
                          'log_format = "json"\n')
    assert Settings().gateway_port == 8000
    s = from_env({}, config_file=cfg)
    assert (s.gateway_port, s.redis_url, s.pool_bytes, s.log_format) == (8100, "redis://file:1/0", 1234, "json")
    s = from_env({"MMFLEET_GATEWAY_PORT": "8200", "REDIS_URL": "redis://env:2/0"}, config_file=cfg)
    assert (s.gateway_port, s.redis_url, s.pool_bytes) == (8200, "redis://env:2/0", 1234)
    s = from_env({"MMFLEET_GATEWAY_PORT": "8200"}, config_file=cfg, gateway_port=8300)
    assert (s.gateway_port, s.pool_bytes) == (8300, 1234)
    assert s.max_attempts == Settings().max_attempts  # untouched keys keep their defaults


def test_cli_flags_and_config_flag(tmp_path):
    cfg = write(tmp_path, 'gateway_port = 8100\nengine = "vllm"\nstage_concurrency = 3\n')
    args = _parser().parse_args(["gateway", "--config", str(cfg), "--port", "8400"])
    s = load_settings(args, env={"MMFLEET_ENGINE": "transformers"})
    assert (s.gateway_port, s.engine, s.stage_concurrency) == (8400, "transformers", 3)


def test_config_from_the_environment_variable(tmp_path):
    cfg = write(tmp_path, "max_attempts = 7\n")
    assert from_env({"MMFLEET_CONFIG": str(cfg)}).max_attempts == 7
    explicit = write(tmp_path, "max_attempts = 9\n")  # --config wins over MMFLEET_CONFIG
    assert from_env({"MMFLEET_CONFIG": str(tmp_path / "nope.toml")}, config_file=explicit).max_attempts == 9


def test_unknown_key_is_an_error_that_names_it(tmp_path):
    cfg = write(tmp_path, "gateway_port = 8100\ngatway_host = '0.0.0.0'\n")
    with pytest.raises(ValueError, match="unknown setting 'gatway_host'"):
        from_env({}, config_file=cfg)
    with pytest.raises(ValueError, match="MMFLEET_GATWAY_HOST"):
        from_env({"MMFLEET_GATWAY_HOST": "x"})
    nested = write(tmp_path, "[gateway]\nport = 1\n")  # tables are not settings
    with pytest.raises(ValueError, match="unknown setting 'gateway'"):
        from_env({}, config_file=nested)


def test_bad_files_and_values_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        from_env({}, config_file=tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="not valid TOML"):
        from_env({}, config_file=write(tmp_path, "gateway_port = = 1\n"))
    with pytest.raises(ValueError, match="gateway_port"):
        from_env({}, config_file=write(tmp_path, 'gateway_port = "eighty"\n'))
    with pytest.raises(ValueError, match="log_format"):
        from_env({"MMFLEET_LOG_FORMAT": "xml"})


def test_tuple_settings_from_file_list_or_string(tmp_path):
    s = from_env({}, config_file=write(tmp_path, 'media_allow_hosts = ["127.0.0.1", "media:8080"]\n'))
    assert s.media_allow_hosts == ("127.0.0.1", "media:8080")
    s = from_env({}, config_file=write(tmp_path, 'media_allow_hosts = "a, b"\n'))
    assert s.media_allow_hosts == ("a", "b")


def test_children_get_the_effective_settings_not_the_file(tmp_path, monkeypatch):
    cfg = write(tmp_path, "gateway_port = 8100\nmetrics_port = 9100\n")
    monkeypatch.setenv("MMFLEET_CONFIG", str(cfg))
    s = from_env(config_file=None)
    env = settings_mod.child_env(s)
    assert "MMFLEET_CONFIG" not in env  # the child must not re-read a file that may have changed
    assert from_env(env) == s


def test_up_gives_each_worker_its_own_metrics_port():
    from services.children import worker_settings
    from services.modes import MODES

    fixed = Settings(metrics_port=9100)
    ports = [worker_settings(fixed, i).metrics_port for i in range(len(MODES["m-e-p-d"]))]
    assert ports == [9100, 9101, 9102, 9103]
    assert {worker_settings(Settings(), i).metrics_port for i in range(4)} == {0}  # each binds a free port
    assert worker_settings(fixed, 2).gateway_port == fixed.gateway_port  # nothing else changes
