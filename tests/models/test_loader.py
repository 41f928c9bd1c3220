"""mtplx.models.load over every fixture family: trunk equality with mlx-lm, incremental
forwards, dtype policy, quantized checkpoints, and clear errors for bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mtplx.models import CheckpointError, load
from mtplx.models.quantized import (
    InvariantQuantizedEmbedding,
    InvariantQuantizedLinear,
    activations_format,
)
from tests.fixtures.tokenizer import IM_END_ID, VOCAB_SIZE

# Float32 everywhere; one-token-at-a-time and multi-token forwards differ only by summation
# order inside matmuls / attention / the gated-delta scan.
ATOL = 1e-4

FAMILIES = {
    "llama_mtp_checkpoint": ("llama", 1),
    "llama_no_mtp_checkpoint": ("llama", 0),
    "qwen3_next_checkpoint": ("qwen3_next", 1),
    "qwen3_5_checkpoint": ("qwen3_5", 1),
    "deepseek_v3_checkpoint": ("deepseek_v3", 1),
    "deepseek_v4_checkpoint": ("deepseek_v41", 1),
}
TOKENS = mx.array([[257, 72, 101, 108, 108, 111, 258, 10, 33, 200]])


@pytest.fixture(scope="module")
def loaded(request: pytest.FixtureRequest):
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load(request.getfixturevalue(name))
        return cache[name]

    return get


@pytest.mark.parametrize("fixture", sorted(FAMILIES))
def test_each_family_loads(fixture: str, loaded) -> None:
    model = loaded(fixture)
    model_type, heads = FAMILIES[fixture]
    assert model.model_type == model_type
    assert len(model.mtp_heads) == heads
    assert model.target.vocab_size == VOCAB_SIZE
    assert model.target.hidden_size == 64
    assert model.context_length == 4096
    assert IM_END_ID in model.eos_token_ids
    prompt = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert prompt[0] == 257 and model.tokenizer.decode(prompt[1:5]) == "user"


@pytest.mark.parametrize("fixture", sorted(FAMILIES))
def test_target_logits_equal_mlx_lm(fixture: str, loaded, request) -> None:
    from mlx_lm.utils import load_model

    reference, _ = load_model(request.getfixturevalue(fixture), strict=False)
    expected = reference(TOKENS)
    target = loaded(fixture).target
    logits, hidden = target(TOKENS, target.make_cache())
    assert logits.shape == (1, TOKENS.shape[1], VOCAB_SIZE)
    assert hidden.shape == (1, TOKENS.shape[1], 64)
    np.testing.assert_allclose(np.array(logits), np.array(expected), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "fixture",
    [
        "llama_mtp_checkpoint",
        "qwen3_next_checkpoint",
        "qwen3_5_checkpoint",
        "deepseek_v3_checkpoint",
    ],
)
def test_one_token_at_a_time_matches_one_forward(fixture: str, loaded) -> None:
    target = loaded(fixture).target
    full_logits, full_hidden = target(TOKENS, target.make_cache())
    cache = target.make_cache()
    steps = [target(TOKENS[:, i : i + 1], cache) for i in range(TOKENS.shape[1])]
    step_logits = mx.concatenate([s[0] for s in steps], axis=1)
    step_hidden = mx.concatenate([s[1] for s in steps], axis=1)
    np.testing.assert_allclose(np.array(step_logits), np.array(full_logits), atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.array(step_hidden), np.array(full_hidden), atol=ATOL, rtol=0)
    # A prefill chunk followed by a multi-token verify-sized chunk: the engine's pattern.
    cache = target.make_cache()
    first, _ = target(TOKENS[:, :6], cache)
    second, _ = target(TOKENS[:, 6:], cache)
    chunked = mx.concatenate([first, second], axis=1)
    np.testing.assert_allclose(np.array(chunked), np.array(full_logits), atol=ATOL, rtol=0)


def test_missing_directory_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load(missing)


def test_hub_repo_without_network_names_the_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="no-such-org/no-such-model"):
        load("no-such-org/no-such-model")


def test_corrupt_safetensors_names_the_file(llama_no_mtp_checkpoint: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(llama_no_mtp_checkpoint, tmp_path / "ckpt"))
    shard = copy / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load(copy)


def test_config_without_model_type_names_the_field(
    llama_no_mtp_checkpoint: Path, tmp_path: Path
) -> None:
    copy = Path(shutil.copytree(llama_no_mtp_checkpoint, tmp_path / "ckpt"))
    config = json.loads((copy / "config.json").read_text())
    del config["model_type"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json.*model_type"):
        load(copy)


def test_missing_config_and_weights_are_named(
    llama_no_mtp_checkpoint: Path, tmp_path: Path
) -> None:
    copy = Path(shutil.copytree(llama_no_mtp_checkpoint, tmp_path / "ckpt"))
    (copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load(copy)
    (copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load(copy)


def test_unsupported_model_type_is_named(unsupported_checkpoint: Path) -> None:
    with pytest.raises(CheckpointError, match="not_a_real_arch"):
        load(unsupported_checkpoint)


def _quantize_checkpoint(source: Path, destination: Path, bits: int) -> Path:
    """An mlx-lm quantized copy (config "quantization", packed weights + scales/biases)."""
    from mlx_lm.utils import load_model

    copy = Path(shutil.copytree(source, destination))
    model, config = load_model(copy)
    nn.quantize(model, group_size=32, bits=bits)
    config["quantization"] = {"group_size": 32, "bits": bits}
    mx.save_safetensors(str(copy / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_checkpoint_loads(
    llama_mtp_checkpoint: Path, tmp_path: Path, bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_lm.utils import load_model

    # The same values multiplied in float32: int8 rows (the default) move logits by their own
    # rounding, which tests/test_quant.py pins against its NumPy twin.
    monkeypatch.setenv("MTPLX_ACTIVATIONS", "float32")

    copy = _quantize_checkpoint(llama_mtp_checkpoint, tmp_path / "q", bits)
    reference, _ = load_model(copy)
    expected = np.array(reference(TOKENS))

    # CPU backend, default: kept quantized, the products on the invariant kernel.
    kept = load(copy)
    modules = [m for _, m in kept.target.trunk.model.named_modules()]
    assert any(isinstance(m, InvariantQuantizedEmbedding) for m in modules)
    assert any(isinstance(m, InvariantQuantizedLinear) for m in modules)
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in modules)
    assert kept.weights.startswith(f"affine q{bits}/g32")
    logits, _ = kept.target(TOKENS, kept.target.make_cache())
    np.testing.assert_allclose(np.array(logits), expected, atol=1e-3, rtol=0)
    assert len(kept.mtp_heads) == 1

    full = load(copy, dequantize=True)  # float32, as MTPLX_WEIGHTS=f32 gives
    modules = [m for _, m in full.target.trunk.model.named_modules()]
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in modules)
    dtypes = {v.dtype for _, v in tree_flatten(full.target.trunk.model.parameters())}
    assert dtypes == {mx.float32}
    assert full.weights == "float32"
    logits, _ = full.target(TOKENS, full.target.make_cache())
    np.testing.assert_allclose(np.array(logits), expected, atol=1e-3, rtol=0)
    assert len(full.mtp_heads) == 1


def test_weights_f32_setting_dequantizes(
    llama_mtp_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = _quantize_checkpoint(llama_mtp_checkpoint, tmp_path / "q", 4)
    monkeypatch.setenv("MTPLX_WEIGHTS", "f32")
    assert load(copy).weights == "float32"
    monkeypatch.setenv("MTPLX_WEIGHTS", "nope")
    with pytest.raises(ValueError, match="MTPLX_WEIGHTS"):
        load(copy)


def test_activations_setting_reaches_every_quantized_product(
    llama_mtp_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MTPLX_ACTIVATIONS picks the kernel's mode when a forward's graph is built: the trunk's
    products and the tied LM head change with it, each mode repeats its own bits, the MTP
    head's products are the same kernel layers, and a bad value is named."""
    copy = _quantize_checkpoint(llama_mtp_checkpoint, tmp_path / "q", 4)
    model = load(copy)
    ids = mx.array([[3, 5, 7, 11, 13]])
    outputs = {}
    for mode in ("float32", "int8", "int8"):
        monkeypatch.setenv("MTPLX_ACTIVATIONS", mode)
        logits = model.target.trunk.owner(ids)  # type: ignore[attr-defined]
        if mode in outputs:
            assert mx.array_equal(outputs[mode], logits).item()
        outputs[mode] = logits
    assert not mx.array_equal(outputs["float32"], outputs["int8"]).item()
    assert mx.allclose(
        outputs["float32"], outputs["int8"], atol=0.05 * float(mx.abs(outputs["float32"]).max())
    ).item()
    head_layers = [
        layer
        for _, layer in tree_flatten(
            model.mtp_heads[0].module.leaf_modules(), is_leaf=nn.Module.is_module
        )
        if isinstance(layer, nn.Linear | nn.QuantizedLinear | InvariantQuantizedLinear)
    ]
    assert head_layers and all(isinstance(layer, InvariantQuantizedLinear) for layer in head_layers)
    monkeypatch.setenv("MTPLX_ACTIVATIONS", "f32")
    assert activations_format() == "float32"
    monkeypatch.setenv("MTPLX_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match="MTPLX_ACTIVATIONS"):
        model.target.trunk.owner(ids)  # type: ignore[attr-defined]


def test_bfloat16_weights_are_cast_to_float32_on_cpu(
    llama_mtp_checkpoint: Path, tmp_path: Path
) -> None:
    copy = Path(shutil.copytree(llama_mtp_checkpoint, tmp_path / "bf16"))
    for file in (copy / "model.safetensors", copy / "mtp.safetensors"):
        arrays = {k: v.astype(mx.bfloat16) for k, v in mx.load(str(file)).items()}
        mx.save_safetensors(str(file), arrays)
    model = load(copy)
    for module in (model.target.trunk.model, model.mtp_heads[0].module):
        assert {v.dtype for _, v in tree_flatten(module.parameters())} == {mx.float32}
