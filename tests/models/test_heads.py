"""MTP heads: checked against a NumPy reference of the head wiring, used recursively, with a
reduced draft vocabulary, and with every MTP weight consumed (missing / unexpected keys are
errors that name the key)."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mtplx.models import CheckpointError, MTPWeightError, load

ATOL = 1e-4
TOKENS = mx.array([[257, 72, 101, 108, 108, 111, 258, 10, 33, 200]])


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def _raw(directory: Path) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update({k: np.array(v) for k, v in mx.load(str(file)).items()})
    return out


def _check_layer_params(layer, raw: dict[str, np.ndarray], prefix: str, zero_centred: bool):
    """Every parameter of the head's decoder layer equals its checkpoint tensor (experts
    stacked; Qwen norms stored zero-centred, i.e. + 1)."""
    suffixes = (
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "q_norm.weight",
        "k_norm.weight",
    )
    for name, value in tree_flatten(layer.parameters()):
        if ".switch_mlp." in name:
            head, tail = name.split(".switch_mlp.")
            count = value.shape[0]
            expected = np.stack([raw[f"{prefix}{head}.experts.{e}.{tail}"] for e in range(count)])
        else:
            expected = raw[prefix + name]
            if zero_centred and name.endswith(suffixes):
                expected = expected + 1.0
        np.testing.assert_array_equal(np.array(value), expected, err_msg=name)


@pytest.mark.parametrize(
    ("fixture", "zero_centred", "lm_head_key", "eps"),
    [
        ("llama_mtp_checkpoint", False, "model.embed_tokens.weight", 1e-5),
        ("qwen3_next_checkpoint", True, "lm_head.weight", 1e-6),
    ],
)
def test_nextn_head_matches_reference(request, fixture, zero_centred, lm_head_key, eps) -> None:
    """x = fc([norm_e(embed(t)), norm_h(h)]); layer; norm; LM head -- vLLM's Qwen3-Next MTP."""
    directory = request.getfixturevalue(fixture)
    model = load(directory)
    raw = _raw(directory)
    head = model.mtp_heads[0]
    _check_layer_params(head.module.layers[0], raw, "mtp.layers.0.", zero_centred)

    target = model.target
    _, hidden = target(TOKENS, target.make_cache())
    hidden_in, next_tokens = hidden[:, :-1], TOKENS[:, 1:]
    logits, out = head(hidden_in, next_tokens, head.make_cache())

    shift = 1.0 if zero_centred else 0.0
    embed = raw["model.embed_tokens.weight"][np.array(next_tokens)]
    x = np.concatenate(
        [
            _rms(embed, raw["mtp.pre_fc_norm_embedding.weight"] + shift, eps),
            _rms(np.array(hidden_in), raw["mtp.pre_fc_norm_hidden.weight"] + shift, eps),
        ],
        axis=-1,
    )
    x = x @ raw["mtp.fc.weight"].T
    y = np.array(head.module.layers[0](mx.array(x), "causal", None))
    ref_out = _rms(y, raw["mtp.norm.weight"] + shift, eps)
    ref_logits = ref_out @ raw[lm_head_key].T
    np.testing.assert_allclose(np.array(out), ref_out, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.array(logits), ref_logits, atol=ATOL, rtol=0)


def test_deepseek_v3_head_matches_reference(deepseek_v3_checkpoint: Path) -> None:
    """x = eh_proj([enorm(embed(t)), hnorm(h)]); block; logits = head(shared_head.norm(x))."""
    model = load(deepseek_v3_checkpoint)
    raw = _raw(deepseek_v3_checkpoint)
    head = model.mtp_heads[0]
    target = model.target
    _, hidden = target(TOKENS, target.make_cache())
    hidden_in, next_tokens = hidden[:, :-1], TOKENS[:, 1:]
    logits, out = head(hidden_in, next_tokens, head.make_cache())

    p, eps = "model.layers.2.", 1e-6
    embed = raw[p + "embed_tokens.weight"][np.array(next_tokens)]
    x = np.concatenate(
        [
            _rms(embed, raw[p + "enorm.weight"], eps),
            _rms(np.array(hidden_in), raw[p + "hnorm.weight"], eps),
        ],
        axis=-1,
    )
    x = x @ raw[p + "eh_proj.weight"].T
    from mlx_lm.models.base import create_attention_mask

    x_mx = mx.array(x)
    y = np.array(
        head.module.block(x_mx, create_attention_mask(x_mx, None, return_array=True), None)
    )
    ref_logits = (
        _rms(y, raw[p + "shared_head.norm.weight"], eps) @ raw[p + "shared_head.head.weight"].T
    )
    np.testing.assert_allclose(np.array(out), y, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.array(logits), ref_logits, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(
        np.array(head.module.block.mlp.switch_mlp.up_proj.weight),
        np.stack([raw[f"{p}mlp.experts.{e}.up_proj.weight"] for e in range(4)]),
    )


@pytest.mark.parametrize(
    "fixture",
    [
        "llama_mtp_checkpoint",
        "qwen3_next_checkpoint",
        "qwen3_5_checkpoint",
        "deepseek_v3_checkpoint",
        "deepseek_v4_checkpoint",
    ],
)
def test_head_recursive_use(request, fixture: str) -> None:
    """Prefill the head over the prompt, then draft 3 tokens recursively from its own hidden
    state; a one-position-at-a-time prefill of the head gives the same result."""
    model = load(request.getfixturevalue(fixture))
    target, head = model.target, model.mtp_heads[0]
    logits, hidden = target(TOKENS, target.make_cache())
    last_token = mx.argmax(logits[:, -1:], axis=-1)  # the target's next token x[T]
    next_tokens = mx.concatenate([TOKENS[:, 1:], last_token], axis=1)

    def draft(cache, step_by_step: bool) -> list[int]:
        if step_by_step:
            outs = [
                head(hidden[:, i : i + 1], next_tokens[:, i : i + 1], cache)
                for i in range(TOKENS.shape[1])
            ]
            head_logits, head_hidden = outs[-1]
        else:
            head_logits, head_hidden = head(hidden, next_tokens, cache)
        drafted = []
        for _ in range(3):
            token = mx.argmax(head_logits[:, -1:], axis=-1)  # [1, 1]
            drafted.append(int(token.item()))
            head_logits, head_hidden = head(head_hidden[:, -1:], token, cache)
            assert head_logits.shape == (1, 1, model.target.vocab_size)
            assert head_hidden.shape == (1, 1, 64)
        return drafted

    assert draft(head.make_cache(), False) == draft(head.make_cache(), True)


def test_head_steps_match_one_call(qwen3_next_checkpoint: Path) -> None:
    model = load(qwen3_next_checkpoint)
    target, head = model.target, model.mtp_heads[0]
    _, hidden = target(TOKENS, target.make_cache())
    full, _ = head(hidden[:, :-1], TOKENS[:, 1:], head.make_cache())
    cache = head.make_cache()
    steps = [
        head(hidden[:, i : i + 1], TOKENS[:, i + 1 : i + 2], cache)[0]
        for i in range(TOKENS.shape[1] - 1)
    ]
    np.testing.assert_allclose(
        np.array(mx.concatenate(steps, axis=1)), np.array(full), atol=ATOL, rtol=0
    )


def test_reduced_draft_vocabulary(llama_draft_vocab_checkpoint: Path) -> None:
    model = load(llama_draft_vocab_checkpoint)
    assert model.draft_vocab is not None
    assert model.draft_vocab.dtype == mx.int32 and model.draft_vocab.shape == (128,)
    raw = _raw(llama_draft_vocab_checkpoint)
    np.testing.assert_array_equal(np.array(model.draft_vocab), raw["mtp.draft_vocab"])
    head = model.mtp_heads[0]
    _, hidden = model.target(TOKENS, model.target.make_cache())
    logits, _ = head(hidden[:, :-1], TOKENS[:, 1:], head.make_cache())
    assert logits.shape == (1, TOKENS.shape[1] - 1, 128)


def _rewrite(file: Path, drop: str | None = None, add: dict[str, mx.array] | None = None) -> None:
    arrays = mx.load(str(file))
    if drop is not None:
        del arrays[drop]
    arrays.update(add or {})
    mx.save_safetensors(str(file), arrays)


def test_missing_mtp_key_is_named(llama_mtp_checkpoint: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(llama_mtp_checkpoint, tmp_path / "c"))
    _rewrite(copy / "mtp.safetensors", drop="mtp.fc.weight")
    with pytest.raises(MTPWeightError, match=r"missing MTP weight 'mtp\.fc\.weight'"):
        load(copy)


def test_unexpected_mtp_key_is_named(llama_mtp_checkpoint: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(llama_mtp_checkpoint, tmp_path / "c"))
    _rewrite(copy / "mtp.safetensors", add={"mtp.extra_proj.weight": mx.zeros((4, 4))})
    with pytest.raises(
        MTPWeightError,
        match=r"unexpected MTP weight 'mtp\.extra_proj\.weight' in .*mtp\.safetensors",
    ):
        load(copy)


def test_extra_mtp_layer_is_unexpected(qwen3_next_checkpoint: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(qwen3_next_checkpoint, tmp_path / "c"))
    extra = {"mtp.layers.1.input_layernorm.weight": mx.zeros((64,))}
    _rewrite(copy / "model.safetensors", add=extra)
    with pytest.raises(MTPWeightError, match=r"mtp\.layers\.1\.input_layernorm\.weight"):
        load(copy)


def test_missing_deepseek_mtp_key_is_named(deepseek_v3_checkpoint: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(deepseek_v3_checkpoint, tmp_path / "c"))
    _rewrite(copy / "model.safetensors", drop="model.layers.2.eh_proj.weight")
    with pytest.raises(MTPWeightError, match=r"model\.layers\.2\.eh_proj\.weight"):
        load(copy)


def test_mtp_weights_argument(llama_no_mtp_checkpoint: Path, llama_mtp_checkpoint: Path) -> None:
    model = load(llama_no_mtp_checkpoint, mtp_weights=llama_mtp_checkpoint / "mtp.safetensors")
    assert len(model.mtp_heads) == 1
    with pytest.raises(FileNotFoundError, match="nope"):
        load(llama_no_mtp_checkpoint, mtp_weights=llama_mtp_checkpoint / "nope.safetensors")


def test_non_mtp_key_in_mtp_file_is_named(llama_mtp_checkpoint: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(llama_mtp_checkpoint, tmp_path / "c"))
    _rewrite(copy / "mtp.safetensors", add={"model.norm.weight": mx.ones((64,))})
    with pytest.raises(
        CheckpointError, match=r"'model\.norm\.weight' in MTP weight file .*mtp\.safetensors"
    ):
        load(copy)


def test_quantized_mtp_weights_load(
    llama_mtp_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MTP linears stored as mlx 4-bit (weight + scales + biases) load quantized or
    dequantized."""
    # The same values multiplied in float32: int8 rows (the default) move logits by their own
    # rounding, which tests/test_quant.py pins against its NumPy twin.
    monkeypatch.setenv("MTPLX_ACTIVATIONS", "float32")
    import mlx.nn as nn

    copy = Path(shutil.copytree(llama_mtp_checkpoint, tmp_path / "c"))
    arrays = mx.load(str(copy / "mtp.safetensors"))
    packed = {}
    for key, value in arrays.items():
        if value.ndim == 2 and value.shape[-1] % 32 == 0:
            weight, scales, biases = mx.quantize(value, group_size=32, bits=4)
            stem = key.removesuffix(".weight")
            packed.update({key: weight, f"{stem}.scales": scales, f"{stem}.biases": biases})
        else:
            packed[key] = value
    mx.save_safetensors(str(copy / "mtp.safetensors"), packed)

    from mtplx.models.quantized import InvariantQuantizedLinear

    # CPU default: kept quantized, on the invariant kernel; dequantize=True: float32.
    kept, default = load(copy), load(copy, dequantize=True)
    assert isinstance(kept.mtp_heads[0].module.fc, InvariantQuantizedLinear)
    assert type(default.mtp_heads[0].module.fc) is nn.Linear
    _, hidden = default.target(TOKENS, default.target.make_cache())
    results = [
        m.mtp_heads[0](hidden, TOKENS, m.mtp_heads[0].make_cache())[0] for m in (kept, default)
    ]
    np.testing.assert_allclose(np.array(results[0]), np.array(results[1]), atol=1e-3, rtol=0)
