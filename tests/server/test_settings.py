"""Settings precedence (CLI > env > file > defaults), config validation, shipped presets."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from server.settings import (
    ConfigError,
    ServerSettings,
    is_loopback,
    load_settings,
    read_config_file,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_defaults(monkeypatch):
    monkeypatch.delenv("MTPLX_PORT", raising=False)
    settings = load_settings()
    assert settings.host == "127.0.0.1" and settings.port == 8000
    assert settings.drafter == "auto" and settings.depth is None and settings.api_key is None


def test_precedence_cli_over_env_over_file(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("port: 9001\nmax_queue: 5\ndepth: 2\nhost: 0.0.0.0\n")
    monkeypatch.setenv("MTPLX_PORT", "9002")
    monkeypatch.setenv("MTPLX_MAX_QUEUE", "6")
    settings = load_settings(config, {"port": 9003, "depth": None})
    assert settings.port == 9003  # CLI
    assert settings.max_queue == 6  # environment
    assert settings.depth == 2  # file (the CLI did not pass depth)
    assert settings.host == "0.0.0.0"  # file
    assert isinstance(settings, ServerSettings)


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("MTPLX_API_KEY", "k")
    assert load_settings().api_key.get_secret_value() == "k"


@pytest.mark.parametrize("key", ["", " ", "\n"])
def test_empty_api_key_is_refused_from_every_source(key, tmp_path, monkeypatch):
    monkeypatch.setenv("MTPLX_API_KEY", key)
    with pytest.raises(ValidationError, match="api_key is empty or whitespace"):
        load_settings()
    monkeypatch.delenv("MTPLX_API_KEY")
    with pytest.raises(ValidationError, match="api_key is empty or whitespace"):
        load_settings(None, {"api_key": key})
    config = tmp_path / "c.yaml"
    config.write_text('api_key: ""\n')
    with pytest.raises(ValidationError, match="api_key is empty or whitespace"):
        load_settings(config)


def test_api_key_with_surrounding_whitespace_is_refused():
    with pytest.raises(ValidationError, match="leading or trailing whitespace"):
        ServerSettings(api_key="k3y\n")


def test_allowed_hosts_and_origins_are_comma_lists(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPLX_ALLOWED_HOSTS", "llm.lan, box.local,")
    monkeypatch.setenv("MTPLX_ALLOWED_ORIGINS", "http://localhost:3000")
    settings = load_settings()
    assert settings.allowed_hosts == ["llm.lan", "box.local"]
    assert settings.allowed_origins == ["http://localhost:3000"]
    config = tmp_path / "c.yaml"
    config.write_text("allowed_hosts: [a.lan]\n")
    monkeypatch.delenv("MTPLX_ALLOWED_HOSTS")
    assert load_settings(config).allowed_hosts == ["a.lan"]
    assert load_settings(config, {"allowed_hosts": "*"}).allowed_hosts == ["*"]
    assert load_settings(None).allowed_origins == ["http://localhost:3000"]


def test_default_config_lists_every_setting_with_its_default(monkeypatch):
    for name in ServerSettings.model_fields:
        monkeypatch.delenv(f"MTPLX_{name.upper()}", raising=False)
    listed = read_config_file(CONFIGS / "default.yaml")
    assert set(listed) == set(ServerSettings.model_fields)
    assert load_settings(CONFIGS / "default.yaml") == load_settings()


def test_unknown_key_in_config_is_named(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("port: 1\nmax_qeue: 3\n")
    with pytest.raises(ConfigError, match="max_qeue"):
        load_settings(config)


def test_bad_value_in_config(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("drafter: telepathy\n")
    with pytest.raises(ValidationError, match="drafter"):
        load_settings(config)


def test_config_must_be_a_mapping(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_settings(config)
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.yaml")


@pytest.mark.parametrize("name", ["default.yaml", "cpu-small.yaml", "apple-silicon-27b.yaml"])
def test_shipped_configs_load(name):
    settings = load_settings(CONFIGS / name)
    assert settings.drafter in ("auto", "mtp", "draft_model", "ngram", "none")


def test_apple_silicon_preset():
    settings = load_settings(CONFIGS / "apple-silicon-27b.yaml")
    assert "27B" in settings.model and settings.drafter == "mtp" and settings.depth == 3


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("localhost", True),
        ("::1", True),
        ("0.0.0.0", False),
        ("10.0.0.2", False),
    ],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", 0), ("1048576", 1 << 20), ("512M", 512 << 20), ("2G", 2 << 30), ("1.5GiB", 3 << 29)],
)
def test_prefix_cache_bytes_takes_sizes(text, expected, tmp_path, monkeypatch):
    assert load_settings(None, {"prefix_cache_bytes": text}).prefix_cache_bytes == expected
    monkeypatch.setenv("MTPLX_PREFIX_CACHE_BYTES", text)
    assert load_settings().prefix_cache_bytes == expected
    config = tmp_path / "c.yaml"
    config.write_text(f"prefix_cache_bytes: {text}\n")
    monkeypatch.delenv("MTPLX_PREFIX_CACHE_BYTES")
    assert load_settings(config).prefix_cache_bytes == expected


@pytest.mark.parametrize("text", ["lots", "-1", "5X", True])
def test_prefix_cache_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(ValidationError):
        load_settings(None, {"prefix_cache_bytes": text})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4G", 4 << 30), ("1048576", 1 << 20), ("none", None), ("null", None), (None, None)],
)
def test_max_kv_bytes_takes_sizes_or_none(text, expected, tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text(f"max_kv_bytes: {'null' if text is None else text}\n")
    assert load_settings(config).max_kv_bytes == expected
    if text is not None:
        monkeypatch.setenv("MTPLX_MAX_KV_BYTES", text)
        assert load_settings().max_kv_bytes == expected


def test_max_kv_bytes_defaults_to_a_bound():
    assert load_settings().max_kv_bytes == 4 << 30


@pytest.mark.parametrize("text", ["lots", "0", "-1", True])
def test_max_kv_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(ValidationError):
        load_settings(None, {"max_kv_bytes": text})


def test_keep_alive_outlasts_a_pooled_client_and_ends_before_the_head_deadline(monkeypatch):
    """An idle connection is closed by the server only after httpx (the openai package's
    transport) has stopped reusing it: at equal timeouts the client reuses the connection
    the server is closing and reads a reset. It closes quietly before the head deadline,
    which would answer an idle connection with a 408."""
    import httpx

    from server.connections import ConnectionLimits

    for name in ("KEEP_ALIVE_TIMEOUT", "HEADER_TIMEOUT"):
        monkeypatch.delenv(f"MTPLX_{name}", raising=False)
    settings = load_settings()
    client_expiry = httpx.Limits().keepalive_expiry
    assert client_expiry is not None
    assert client_expiry < settings.keep_alive_timeout < settings.header_timeout
    assert ConnectionLimits().keep_alive_timeout == settings.keep_alive_timeout


def test_a_keep_alive_past_the_head_deadline_is_refused(monkeypatch):
    monkeypatch.setenv("MTPLX_KEEP_ALIVE_TIMEOUT", "12")
    monkeypatch.delenv("MTPLX_HEADER_TIMEOUT", raising=False)
    with pytest.raises(ValidationError, match=r"keep_alive_timeout .* below header"):
        load_settings()
    monkeypatch.setenv("MTPLX_HEADER_TIMEOUT", "20")
    assert load_settings().keep_alive_timeout == 12
