"""Compiled layer pieces of the slot target: the same bits as the uncompiled path, used where
they describe the layers, and left out where they do not."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from mtplx.models import load
from mtplx.models.compiled_layer import CompiledLayer
from mtplx.models.slot_layout import ATTEND_STEP
from mtplx.models.slot_target import SlotTarget
from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.variants import quantize_checkpoint


@pytest.fixture(scope="module", params=["float32", "q4", "q8"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The llama fixture in float32, and quantized (its products on the invariant kernel,
    fused and compiled like the float ones)."""
    directory = tmp_path_factory.mktemp("compiled_layer")
    build_checkpoint("llama_mtp", directory)
    if request.param != "float32":
        quantize_checkpoint(directory, bits=int(request.param[1:]), group_size=64)
    return load(directory)


def _tokens(seed: int, length: int) -> list[int]:
    return [(5 + 7 * seed + 13 * j * j) % 250 + 3 for j in range(length)]


# (row, tokens) fed per forward: prefill chunks below and above the query block (the latter
# take the uncompiled path), verify rows of 1-6 tokens beside each other and beside a chunk,
# a row past the store's first capacity step (the compiled attention's shape changes).
PLAN: list[list[tuple[int, list[int]]]] = [
    [(0, _tokens(0, 30))],
    [(1, _tokens(1, 90))],
    [(0, [3]), (1, [4, 5])],
    [(0, [6, 7, 8]), (1, [9]), (2, _tokens(2, 13))],
    [(2, [1, 2, 3, 4, 5, 6])],
    [(1, _tokens(3, 200))],
    [(0, [11]), (1, [12]), (2, [13, 14])],
    [(3, [1])],
    [(0, [2]), (3, [3, 4])],
]


def _run(target: SlotTarget) -> list[list[tuple[mx.array, mx.array]]]:
    rows = [target.new_row() for _ in range(4)]
    outputs = []
    for step in PLAN:
        out = target.forward(
            [rows[i] for i, _ in step], [mx.array(t, mx.int32) for _, t in step], "all"
        )
        mx.eval([(o.logits, o.hidden) for o in out])
        outputs.append([(o.logits, o.hidden) for o in out])
    return outputs


@pytest.mark.parametrize("attention", ["mlx", "kernel"])
def test_compiled_forwards_give_the_uncompiled_bits(
    model, monkeypatch: pytest.MonkeyPatch, attention: str
) -> None:
    """Both attention paths: MLX's ops (the compiled ``attend`` piece) and the fused kernel
    (called from both paths alike)."""
    compiled = SlotTarget(model.target, max_rows=8, attention=attention)
    assert compiled._compiled is not None  # the fixture is the default model's family
    calls = []
    attend = compiled._compiled.attend
    monkeypatch.setattr(
        compiled._compiled, "attend", lambda *a: calls.append(a[1].shape[-1]) or attend(*a)
    )
    plain = SlotTarget(model.target, max_rows=8, attention=attention)
    plain._compiled = None
    expected, got = _run(plain), _run(compiled)
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        for (logits, hidden), (logits2, hidden2) in zip(want, have, strict=True):
            assert mx.array_equal(logits, logits2).item(), step
            assert mx.array_equal(hidden, hidden2).item(), step
    # the compiled attention ran over each group's key length rounded up to ATTEND_STEP
    # (64): rows of 30-103 positions, then row 1 at 296 after its 200-token chunk -- never the
    # store's whole capacity (512 by then)
    assert ATTEND_STEP == 64
    if attention == "kernel":
        assert not calls  # the kernel reads each token's keys up to its own count
        return
    assert calls and set(calls) == {64, 128, 320}


def test_a_short_row_attends_over_its_span_beside_a_grown_store(model, monkeypatch) -> None:
    """A long row grows every slot's store, which stays grown while other rows run; a short
    row then attends over its own span (same bits as beside no long row), not the capacity.
    (MLX's attention ops: the fused kernel reads a token's keys up to its count alone.)"""
    results, spans = [], []
    for with_long_row in (True, False):
        target = SlotTarget(model.target, max_rows=8, attention="mlx")
        short = target.new_row()
        logits = [target.forward([short], [mx.array(_tokens(7, 20), mx.int32)], "all")[0].logits]
        if with_long_row:
            long_row = target.new_row()
            for start in range(0, 600, 60):  # chunks within the query block: compiled path
                out = target.forward([long_row], [mx.array(_tokens(start, 60), mx.int32)], "none")
            mx.eval(out[0].hidden)
            target.release(long_row)
            assert target._shared.capacity >= 600
            attend = target._compiled.attend

            def recording(*args: mx.array, attend=attend) -> mx.array:
                spans.append(args[1].shape[-1])
                return attend(*args)

            monkeypatch.setattr(target._compiled, "attend", recording)
        for tokens in ([4], [5, 6]):
            logits.append(target.forward([short], [mx.array(tokens, mx.int32)], "all")[0].logits)
        mx.eval(logits)
        results.append(logits)
    for got, want in zip(*results, strict=True):
        assert mx.array_equal(got, want).item()
    assert spans and max(spans) == ATTEND_STEP


def _like(layer: Any, **attention: Any) -> SimpleNamespace:
    """A stand-in for ``layer`` with what ``for_trunk`` reads, attention parts replaced."""
    attn = layer.self_attn
    parts = {name: getattr(attn, name) for name in ("n_heads", "n_kv_heads", "o_proj", "rope")}
    return SimpleNamespace(
        self_attn=SimpleNamespace(**{**parts, **attention}),
        mlp=layer.mlp,
        input_layernorm=layer.input_layernorm,
        post_attention_layernorm=layer.post_attention_layernorm,
    )


def test_layers_the_pieces_do_not_describe_keep_the_uncompiled_path(model) -> None:
    target = SlotTarget(model.target, max_rows=2)
    layers = [_like(layer) for layer in target.trunk.inner.layers]
    fused = list(target._fused)
    assert CompiledLayer.for_trunk(layers, fused) is not None  # the stand-ins themselves pass

    out, hidden = fused[0].qkv.shape[0], fused[0].qkv.shape[1]
    changed = {
        "a biased o_proj": (-1, {"o_proj": nn.Linear(hidden, hidden, bias=True)}),
        "another RoPE": (0, {"rope": nn.RoPE(8, base=1234.0)}),
        "other head counts": (1, {"n_kv_heads": layers[1].self_attn.n_heads}),
    }
    for what, (index, attention) in changed.items():
        variant = list(layers)
        variant[index] = _like(target.trunk.inner.layers[index], **attention)
        assert CompiledLayer.for_trunk(variant, fused) is None, what
    assert CompiledLayer.for_trunk(layers, [None, *fused[1:]]) is None  # unfused (quantised)
    biased = replace(fused[-1], qkv_bias=mx.zeros((out,)))
    assert CompiledLayer.for_trunk(layers, [*fused[:-1], biased]) is None
