"""``mtplx generate`` and the engine side of ``mtplx serve``: argument handling, the engine
factory, the /health BLAS description and the terminal generator (engine faked)."""

from __future__ import annotations

import sys
import types

import pytest

from mtplx import cli, commands
from tests.fake_engine import FakeEngine, install_fake_engine_modules


@pytest.fixture
def fake_engine_modules(monkeypatch):
    """Stand-ins for mtplx.engine.Engine and mtplx.models.load, recording their calls."""
    return install_fake_engine_modules(monkeypatch)


def test_engine_factory_builds_engine_lazily(fake_engine_modules):
    build = commands.engine_factory("/ckpt", "ngram", 4, max_num_seqs=6)
    assert "engine" not in fake_engine_modules  # nothing loads until the engine thread asks
    engine = build()
    assert fake_engine_modules["engine"] == ("loaded:/ckpt", "ngram", 4)
    assert fake_engine_modules["sizes"]["max_num_seqs"] == 6
    assert engine.default_drafter == "ngram"
    assert fake_engine_modules["warm_up"]  # cycle costs are measured before serving


def test_missing_default_model_fails_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, "mtplx.models.gguf", None)  # import fails
    with pytest.raises(SystemExit, match="default model is unavailable"):
        commands.engine_factory(None, "mtp", None)


def test_default_model_is_resolved_on_the_engine_thread(monkeypatch, fake_engine_modules):
    gguf = types.ModuleType("mtplx.models.gguf")
    gguf.ensure_default_model = lambda: "/models/default"
    monkeypatch.setitem(sys.modules, "mtplx.models.gguf", gguf)
    commands.engine_factory(None, "mtp", None)()
    assert fake_engine_modules["engine"][0] == "loaded:/models/default"


@pytest.mark.parametrize("depth", ["-1", "17", "deep"])
def test_bad_depth_is_an_argument_error(depth, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "m", "--depth", depth])
    assert "depth" in capsys.readouterr().err


def test_generate_streams_to_stdout(monkeypatch, capsys):
    engine = FakeEngine()
    monkeypatch.setattr(commands, "engine_factory", lambda *a: lambda: engine)
    argv = ["generate", "m", "--prompt", "hi", "--max-tokens", "12", "--seed", "1"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out.strip() == engine.expected_text(engine.requests[-1]).strip()
    assert "12 tokens" in err
    assert bytes(engine.requests[-1].prompt_ids).decode() == "<|user|>hi\n<|assistant|>"
    assert cli.main([*argv, "--raw", "--quiet"]) == 0
    assert bytes(engine.requests[-1].prompt_ids) == b"hi"


def test_generate_reports_bad_values(monkeypatch, capsys):
    monkeypatch.setattr(commands, "engine_factory", lambda *a: FakeEngine)
    assert cli.main(["generate", "--prompt", "hi", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_bad_draft_layers_is_an_argument_error(value, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "m", "--draft-layers", value])
    assert "positive integer" in capsys.readouterr().err


def test_draft_layers_adds_a_layer_skip_draft_model(llama_mtp_checkpoint):
    engine = commands.engine_factory(str(llama_mtp_checkpoint), "draft_model", 2, 1)()
    assert "draft_model" in engine.available_drafters
    assert engine.default_drafter == "draft_model" and engine.default_depth == 2


def test_health_blas_comes_from_mtplx_blas():
    import mtplx.quant
    from mtplx.blas import blas_info
    from mtplx.models.quantized import activations_format

    described = commands.describe_blas()
    info = blas_info()
    assert described == {
        "name": info.name,
        "threads": info.threads,
        "fast": info.fast,
        "fallback_reason": info.fallback_reason,
        # the quantized kernel once a quantized model loaded it, else None
        "quantized_kernel": mtplx.quant.quant_info().kernel if mtplx.quant.loaded() else None,
        # and how it treats its rows (MTPLX_ACTIVATIONS)
        "quantized_activations": activations_format() if mtplx.quant.loaded() else None,
    }


def test_health_blas_shows_no_paths(monkeypatch):
    # /health answers without the API key: the library's location stays private.
    import mtplx.blas
    from mtplx.blas import BlasInfo

    shim = BlasInfo(
        name="openblas", library="/home/me/.cache/mtplx/libshim.so", threads=4, fast=True
    )
    monkeypatch.setattr(mtplx.blas, "blas_info", lambda: shim)
    monkeypatch.setattr(commands, "_quantized_kernel", lambda: "mtplx-invariant-avx2")
    monkeypatch.setattr(commands, "_quantized_activations", lambda: "int8")
    assert commands.describe_blas() == {
        "name": "openblas",
        "threads": 4,
        "fast": True,
        "fallback_reason": None,
        "quantized_kernel": "mtplx-invariant-avx2",
        "quantized_activations": "int8",
    }
    failed = BlasInfo(
        name="reference",
        library=None,
        threads=1,
        fast=False,
        fallback_reason="OSError: /opt/x/libopenblas.so: cannot open shared object file",
    )
    monkeypatch.setattr(mtplx.blas, "blas_info", lambda: failed)
    reason = commands.describe_blas()["fallback_reason"]
    assert reason == "OSError: <path>: cannot open shared object file"


def test_generate_on_a_real_checkpoint(llama_mtp_checkpoint, capsys):
    argv = ["generate", str(llama_mtp_checkpoint), "--prompt", "hi", "--max-tokens", "6"]
    assert cli.main([*argv, "--draft-layers", "1", "--drafter", "draft_model"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and "cycles" in err
    assert cli.main([*argv, "--drafter", "draft_model"]) == 2
    assert "--draft-layers" in capsys.readouterr().err
