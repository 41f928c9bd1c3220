"""``mtplx serve``'s server side (``server.main``): settings precedence from the command
line, start-up refusals, and the engine factory wired to uvicorn (engine faked)."""

from __future__ import annotations

import pytest

from mtplx import cli
from server import main as server_main
from tests.fake_engine import install_fake_engine_modules


@pytest.fixture
def fake_engine_modules(monkeypatch):
    """Stand-ins for mtplx.engine.Engine and mtplx.models.load, recording their calls."""
    return install_fake_engine_modules(monkeypatch)


def test_non_loopback_without_key_refuses(capsys, monkeypatch):
    monkeypatch.delenv("MTPLX_API_KEY", raising=False)
    assert cli.main(["serve", "m", "--host", "0.0.0.0"]) == 2
    assert "API key" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
@pytest.mark.parametrize("key", ["", "   "])
def test_empty_api_key_is_refused_at_start_up(host, key, capsys, monkeypatch):
    # An empty key used to pass the public-bind guard and then match requests that send
    # no Authorization header at all.
    monkeypatch.setattr(server_main, "run_server", lambda *a: pytest.fail("server started"))
    monkeypatch.delenv("MTPLX_API_KEY", raising=False)
    assert cli.main(["serve", "m", "--host", host, "--api-key", key]) == 2
    assert "api_key is empty or whitespace" in capsys.readouterr().err
    monkeypatch.setenv("MTPLX_API_KEY", key)
    assert cli.main(["serve", "m", "--host", host]) == 2
    assert "api_key is empty or whitespace" in capsys.readouterr().err


def test_bad_api_key_message_does_not_echo_the_key(capsys, monkeypatch):
    monkeypatch.setattr(server_main, "run_server", lambda *a: pytest.fail("server started"))
    assert cli.main(["serve", "m", "--api-key", "s3cret-value "]) == 2
    err = capsys.readouterr().err
    assert "leading or trailing whitespace" in err and "s3cret" not in err


def test_allowed_hosts_and_origins_from_the_command_line(monkeypatch, fake_engine_modules):
    seen = {}
    monkeypatch.setattr(server_main, "run_server", lambda app, *a: seen.update(app=app))
    argv = ["serve", "/ckpt", "--allowed-hosts", "llm.lan,box.local"]
    assert cli.main([*argv, "--allowed-origins", "http://localhost:3000"]) == 0
    settings = seen["app"].state.ctx.settings
    assert settings.allowed_hosts == ["llm.lan", "box.local"]
    assert settings.allowed_origins == ["http://localhost:3000"]


def test_unknown_config_key_is_reported(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("prot: 1\n")
    assert cli.main(["serve", "m", "--config", str(config)]) == 2
    assert "prot" in capsys.readouterr().err


def test_serve_runs_uvicorn_with_merged_settings(tmp_path, monkeypatch, fake_engine_modules):
    config = tmp_path / "c.yaml"
    config.write_text("port: 9100\nmax_queue: 3\ndrafter: ngram\n")
    monkeypatch.setenv("MTPLX_MAX_QUEUE", "4")
    seen = {}

    def fake_run(app, bridge, host, port, log_level, shutdown_timeout, limits):
        seen.update(app=app, host=host, port=port, shutdown_timeout=shutdown_timeout, limits=limits)

    monkeypatch.setattr(server_main, "run_server", fake_run)
    argv = ["serve", "/ckpt", "--config", str(config), "--depth", "adaptive", "--port", "9200"]
    assert cli.main([*argv, "--host", "0.0.0.0", "--api-key", "k"]) == 0
    ctx = seen["app"].state.ctx
    assert (seen["host"], seen["port"]) == ("0.0.0.0", 9200)
    assert seen["shutdown_timeout"] == 30.0
    assert seen["limits"].max_connections == 1024 and seen["limits"].header_timeout == 10.0
    assert ctx.settings.max_queue == 4 and ctx.bridge.max_queue == 4
    assert ctx.settings.drafter == "ngram" and ctx.settings.depth is None
    assert ctx.settings.api_key.get_secret_value() == "k"


def test_draft_model_without_draft_layers_is_refused(capsys):
    assert cli.main(["serve", "m", "--drafter", "draft_model"]) == 2
    assert "--draft-layers" in capsys.readouterr().err


def test_unavailable_drafter_stops_the_server_with_a_clear_error(
    llama_no_mtp_checkpoint, capsys, monkeypatch
):
    for name in ("MTPLX_API_KEY", "MTPLX_HOST", "MTPLX_PORT", "MTPLX_DRAFTER"):
        monkeypatch.delenv(name, raising=False)
    argv = ["serve", str(llama_no_mtp_checkpoint), "--drafter", "mtp", "--port", "0"]
    argv += ["--log-level", "error"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "--drafter mtp is not available" in err and "no MTP heads" in err
    assert "available drafters: none, ngram" in err


def test_a_port_in_use_stops_serve_before_the_engine_loads(
    capsys, monkeypatch, fake_engine_modules
):
    # uvicorn binds after the lifespan started the engine thread: a failed bind then exited
    # while the model loaded there (the process aborted). The address is checked first.
    import socket

    for name in ("MTPLX_API_KEY", "MTPLX_HOST", "MTPLX_PORT"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert server_main.listen_problem("127.0.0.1", port) is not None
        with pytest.raises(server_main.CannotListen, match="in use"):
            server_main.run_server(None, None, "127.0.0.1", port, "error")
        assert cli.main(["serve", "/ckpt", "--port", str(port), "--log-level", "error"]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert "engine" not in fake_engine_modules  # the engine was never built
    assert server_main.listen_problem("127.0.0.1", port) is None
