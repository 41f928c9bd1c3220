"""``mtplx serve`` / ``mtplx generate``: argument handling, settings precedence from the
command line, the engine factory and the terminal generator (engine faked)."""

from __future__ import annotations

import sys
import types

import pytest

from mtplx import cli
from mtplx import serve as serve_commands
from tests.fake_engine import FakeEngine


@pytest.fixture
def fake_engine_modules(monkeypatch):
    """Stand-ins for mtplx.engine.Engine and mtplx.models.load, recording their calls."""
    calls = {}

    class Engine(FakeEngine):
        def __init__(
            self, loaded, default_drafter="mtp", default_depth=None, draft_model=None, **sizes
        ):
            calls["engine"] = (loaded.path, default_drafter, default_depth)
            calls["sizes"] = sizes
            super().__init__(default_drafter=default_drafter, default_depth=default_depth)

        def warm_up(self):
            calls["warm_up"] = True

    engine_module = types.ModuleType("mtplx.engine")
    engine_module.Engine = Engine
    monkeypatch.setitem(sys.modules, "mtplx.engine", engine_module)
    import mtplx.models

    def load(path):
        return types.SimpleNamespace(path=f"loaded:{path}", mtp_heads=["head"])

    monkeypatch.setattr(mtplx.models, "load", load, raising=False)
    return calls


def test_engine_factory_builds_engine_lazily(fake_engine_modules):
    build = serve_commands.engine_factory("/ckpt", "ngram", 4, max_num_seqs=6)
    assert "engine" not in fake_engine_modules  # nothing loads until the engine thread asks
    engine = build()
    assert fake_engine_modules["engine"] == ("loaded:/ckpt", "ngram", 4)
    assert fake_engine_modules["sizes"]["max_num_seqs"] == 6
    assert engine.default_drafter == "ngram"
    assert fake_engine_modules["warm_up"]  # cycle costs are measured before serving


def test_missing_default_model_fails_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, "mtplx.models.gguf", None)  # import fails
    with pytest.raises(SystemExit, match="default model is unavailable"):
        serve_commands.engine_factory(None, "mtp", None)


def test_default_model_is_resolved_on_the_engine_thread(monkeypatch, fake_engine_modules):
    gguf = types.ModuleType("mtplx.models.gguf")
    gguf.ensure_default_model = lambda: "/models/default"
    monkeypatch.setitem(sys.modules, "mtplx.models.gguf", gguf)
    serve_commands.engine_factory(None, "mtp", None)()
    assert fake_engine_modules["engine"][0] == "loaded:/models/default"


@pytest.mark.parametrize("depth", ["-1", "17", "deep"])
def test_bad_depth_is_an_argument_error(depth, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "m", "--depth", depth])
    assert "depth" in capsys.readouterr().err


def test_non_loopback_without_key_refuses(capsys, monkeypatch):
    monkeypatch.delenv("MTPLX_API_KEY", raising=False)
    assert cli.main(["serve", "m", "--host", "0.0.0.0"]) == 2
    assert "API key" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
@pytest.mark.parametrize("key", ["", "   "])
def test_empty_api_key_is_refused_at_start_up(host, key, capsys, monkeypatch):
    # An empty key used to pass the public-bind guard and then match requests that send
    # no Authorization header at all.
    monkeypatch.setattr(serve_commands, "run_server", lambda *a: pytest.fail("server started"))
    monkeypatch.delenv("MTPLX_API_KEY", raising=False)
    assert cli.main(["serve", "m", "--host", host, "--api-key", key]) == 2
    assert "api_key is empty or whitespace" in capsys.readouterr().err
    monkeypatch.setenv("MTPLX_API_KEY", key)
    assert cli.main(["serve", "m", "--host", host]) == 2
    assert "api_key is empty or whitespace" in capsys.readouterr().err


def test_bad_api_key_message_does_not_echo_the_key(capsys, monkeypatch):
    monkeypatch.setattr(serve_commands, "run_server", lambda *a: pytest.fail("server started"))
    assert cli.main(["serve", "m", "--api-key", "s3cret-value "]) == 2
    err = capsys.readouterr().err
    assert "leading or trailing whitespace" in err and "s3cret" not in err


def test_allowed_hosts_and_origins_from_the_command_line(monkeypatch, fake_engine_modules):
    seen = {}
    monkeypatch.setattr(serve_commands, "run_server", lambda app, *a: seen.update(app=app))
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

    def fake_run(app, scheduler, host, port, log_level, shutdown_timeout, limits):
        seen.update(app=app, host=host, port=port, shutdown_timeout=shutdown_timeout, limits=limits)

    monkeypatch.setattr(serve_commands, "run_server", fake_run)
    argv = ["serve", "/ckpt", "--config", str(config), "--depth", "adaptive", "--port", "9200"]
    assert cli.main([*argv, "--host", "0.0.0.0", "--api-key", "k"]) == 0
    ctx = seen["app"].state.ctx
    assert (seen["host"], seen["port"]) == ("0.0.0.0", 9200)
    assert seen["shutdown_timeout"] == 30.0
    assert seen["limits"].max_connections == 1024 and seen["limits"].header_timeout == 10.0
    assert ctx.settings.max_queue == 4 and ctx.scheduler.max_queue == 4
    assert ctx.settings.drafter == "ngram" and ctx.settings.depth is None
    assert ctx.settings.api_key.get_secret_value() == "k"


def test_generate_streams_to_stdout(monkeypatch, capsys):
    engine = FakeEngine()
    monkeypatch.setattr(serve_commands, "engine_factory", lambda *a: lambda: engine)
    argv = ["generate", "m", "--prompt", "hi", "--max-tokens", "12", "--seed", "1"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out.strip() == engine.expected_text(engine.requests[-1]).strip()
    assert "12 tokens" in err
    assert bytes(engine.requests[-1].prompt_ids).decode() == "<|user|>hi\n<|assistant|>"
    assert cli.main([*argv, "--raw", "--quiet"]) == 0
    assert bytes(engine.requests[-1].prompt_ids) == b"hi"


def test_generate_reports_bad_values(monkeypatch, capsys):
    monkeypatch.setattr(serve_commands, "engine_factory", lambda *a: FakeEngine)
    assert cli.main(["generate", "--prompt", "hi", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_draft_model_without_draft_layers_is_refused(capsys):
    assert cli.main(["serve", "m", "--drafter", "draft_model"]) == 2
    assert "--draft-layers" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_bad_draft_layers_is_an_argument_error(value, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "m", "--draft-layers", value])
    assert "positive integer" in capsys.readouterr().err


def test_draft_layers_adds_a_layer_skip_draft_model(llama_mtp_checkpoint):
    engine = serve_commands.engine_factory(str(llama_mtp_checkpoint), "draft_model", 2, 1)()
    assert "draft_model" in engine.available_drafters
    assert engine.default_drafter == "draft_model" and engine.default_depth == 2


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


def test_health_blas_comes_from_mtplx_blas():
    import mtplx.quant
    from mtplx.blas import blas_info

    described = serve_commands.describe_blas()
    info = blas_info()
    assert described == {
        "name": info.name,
        "threads": info.threads,
        "fast": info.fast,
        "fallback_reason": info.fallback_reason,
        # the quantized kernel once a quantized model loaded it, else None
        "quantized_kernel": mtplx.quant.quant_info().kernel if mtplx.quant.loaded() else None,
    }


def test_health_blas_shows_no_paths(monkeypatch):
    # /health answers without the API key: the library's location stays private.
    import mtplx.blas
    from mtplx.blas import BlasInfo

    shim = BlasInfo(
        name="openblas", library="/home/me/.cache/mtplx/libshim.so", threads=4, fast=True
    )
    monkeypatch.setattr(mtplx.blas, "blas_info", lambda: shim)
    monkeypatch.setattr(serve_commands, "_quantized_kernel", lambda: "mtplx-invariant-avx2")
    assert serve_commands.describe_blas() == {
        "name": "openblas",
        "threads": 4,
        "fast": True,
        "fallback_reason": None,
        "quantized_kernel": "mtplx-invariant-avx2",
    }
    failed = BlasInfo(
        name="reference",
        library=None,
        threads=1,
        fast=False,
        fallback_reason="OSError: /opt/x/libopenblas.so: cannot open shared object file",
    )
    monkeypatch.setattr(mtplx.blas, "blas_info", lambda: failed)
    reason = serve_commands.describe_blas()["fallback_reason"]
    assert reason == "OSError: <path>: cannot open shared object file"


def test_generate_on_a_real_checkpoint(llama_mtp_checkpoint, capsys):
    argv = ["generate", str(llama_mtp_checkpoint), "--prompt", "hi", "--max-tokens", "6"]
    assert cli.main([*argv, "--draft-layers", "1", "--drafter", "draft_model"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and "cycles" in err
    assert cli.main([*argv, "--drafter", "draft_model"]) == 2
    assert "--draft-layers" in capsys.readouterr().err
