"""mtplx.models.stages: how a trunk's decoder layers split into pipeline stages, and loading
one stage only."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest

from mtplx.models import load
from mtplx.models.stages import keep_stage, stage_layers


def test_stage_layers_are_contiguous_and_cover_every_layer():
    for num_layers in range(1, 40):
        for num_ranks in range(1, min(num_layers, 6) + 1):
            stages = stage_layers(num_layers, num_ranks)
            assert [layer for stage in stages for layer in stage] == list(range(num_layers))
            sizes = [len(stage) for stage in stages]
            assert max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes)  # rank 0, which also runs the heads, never has more
    assert stage_layers(30, 4) == [range(0, 7), range(7, 14), range(14, 22), range(22, 30)]


@pytest.mark.parametrize("num_layers, num_ranks", [(2, 3), (4, 0)])
def test_stage_layers_refuses_impossible_splits(num_layers, num_ranks):
    with pytest.raises(ValueError, match="cannot split"):
        stage_layers(num_layers, num_ranks)


def test_keep_stage_loads_only_the_stage_layers(llama_mtp_checkpoint):
    full = load(llama_mtp_checkpoint)
    first = load(llama_mtp_checkpoint, stage=(0, 2))
    second = load(llama_mtp_checkpoint, stage=(1, 2))
    layers = full.target.trunk.inner.layers
    assert len(layers) == 2
    assert len(first.target.trunk.inner.layers) == len(second.target.trunk.inner.layers) == 1
    for stage, index in ((first, 0), (second, 1)):
        kept = stage.target.trunk.inner.layers[0]
        assert mx.array_equal(
            kept.self_attn.q_proj.weight, layers[index].self_attn.q_proj.weight
        ).item()
    trunk = SimpleNamespace(inner=SimpleNamespace(layers=list("abcde")))
    assert keep_stage(trunk, 1, 2) == range(2, 5)
    assert trunk.inner.layers == ["c", "d", "e"]
