"""``inspect`` / ``mtplx inspect``: tiers, exit codes, drafters, for every fixture family."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mtplx.cli import main
from mtplx.models import Tier, inspect

EXPECTED = {
    "llama_mtp_checkpoint": (
        Tier.VERIFIED,
        0,
        1,
        ["mtp", "draft_model (layer-skip)", "ngram", "none"],
    ),
    "llama_no_mtp_checkpoint": (Tier.NO_MTP, 11, 0, ["draft_model (layer-skip)", "ngram", "none"]),
    "qwen3_next_checkpoint": (Tier.VERIFIED, 0, 1, ["mtp", "ngram", "none"]),
    "qwen3_5_checkpoint": (Tier.VERIFIED, 0, 1, ["mtp", "ngram", "none"]),
    "deepseek_v3_checkpoint": (Tier.VERIFIED, 0, 1, ["mtp", "ngram", "none"]),
    "deepseek_v4_checkpoint": (Tier.UNVERIFIED, 10, 1, ["mtp", "ngram", "none"]),
    "unsupported_checkpoint": (Tier.UNSUPPORTED, 12, 0, []),
}


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_inspect_tier_and_exit_code(request, fixture: str, capsys) -> None:
    directory = request.getfixturevalue(fixture)
    tier, code, layers, drafters = EXPECTED[fixture]
    report = inspect(directory)
    assert report.tier is tier
    assert report.exit_code == code
    assert report.mtp_layers == layers
    assert report.drafters == drafters
    assert report.context_length == (2048 if fixture == "unsupported_checkpoint" else 4096)
    assert report.parameter_count > 0
    assert main(["inspect", str(directory)]) == code
    out = capsys.readouterr().out
    assert f"tier:             {tier.value}" in out
    assert "parameters:" in out and "context length:" in out


def test_inspect_reports_dtype_and_mtp_file(llama_mtp_checkpoint: Path) -> None:
    report = inspect(llama_mtp_checkpoint)
    assert report.dtype == "float32"
    assert [p.name for p in report.mtp_files] == ["mtp.safetensors"]
    assert report.mtp_layout == "nextn"


def test_inspect_errors_exit_2(tmp_path: Path, llama_no_mtp_checkpoint: Path, capsys) -> None:
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
    copy = Path(shutil.copytree(llama_no_mtp_checkpoint, tmp_path / "c"))
    (copy / "config.json").write_text(json.dumps({"hidden_size": 64}))
    assert main(["inspect", str(copy)]) == 2
    assert "model_type" in capsys.readouterr().err


def test_inspect_quantized_dtype(llama_no_mtp_checkpoint: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(llama_no_mtp_checkpoint, tmp_path / "c"))
    config = json.loads((copy / "config.json").read_text())
    config["quantization"] = {"group_size": 64, "bits": 4}
    (copy / "config.json").write_text(json.dumps(config))
    assert inspect(copy).dtype == "4-bit (group 64)"


def test_inspect_names_the_served_weights_and_kernel(
    llama_mtp_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from mtplx import quant
    from mtplx.models.quantized import activations_format
    from tests.fixtures.variants import quantize_checkpoint

    monkeypatch.delenv("MTPLX_WEIGHTS", raising=False)
    monkeypatch.delenv("MTPLX_ACTIVATIONS", raising=False)
    # main() sets MTPLX_ACTIVATIONS from --activations; monkeypatch restores it after.
    monkeypatch.setenv("MTPLX_ACTIVATIONS", activations_format())
    assert inspect(llama_mtp_checkpoint).weights == "float32"
    assert inspect(llama_mtp_checkpoint).kernel == "mtplx-invariant-f32 (BLAS shim)"
    copy = quantize_checkpoint(Path(shutil.copytree(llama_mtp_checkpoint, tmp_path / "q")))
    report = inspect(copy)
    assert report.weights == "4-bit affine (group 32), served quantized"
    assert report.kernel == quant.quant_info().kernel == f"mtplx-invariant-{quant.kernel_variant()}"
    assert report.activations == activations_format()
    assert inspect(llama_mtp_checkpoint).activations == ""  # float32: no quantized kernel
    main(["inspect", str(copy), "--activations", "int8"])
    out = capsys.readouterr().out
    assert "weights served:   4-bit affine (group 32), served quantized" in out
    assert f"kernel:           {report.kernel} (int8 activations)" in out
    main(["inspect", str(copy), "--activations", "float32"])
    assert f"kernel:           {report.kernel} (float32 activations)" in capsys.readouterr().out
    monkeypatch.setenv("MTPLX_WEIGHTS", "f32")
    assert inspect(copy).weights == "float32 (dequantized: MTPLX_WEIGHTS=f32)"
