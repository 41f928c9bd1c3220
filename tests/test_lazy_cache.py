"""The lazy KV cache: trims by counts still computing give the head what eager trims give."""

from __future__ import annotations

import io

import mlx.core as mx
import pytest

from mtplx.lazy_cache import STEP, LazyKVCache
from mtplx.models import load
from tests.fixtures.checkpoints import build_checkpoint


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("lazy_cache")
    build_checkpoint("llama_mtp", directory)
    return load(directory).mtp_heads[0]


def test_lazy_trims_give_the_head_the_outputs_of_eager_trims(head) -> None:
    """Feeds of 3 pairs whose last ones are dropped again, eagerly (mlx-lm's KVCache) and
    lazily (the count an unevaluated array), across the capacity step."""
    size = head.trunk.hidden_size
    eager, lazy = head.make_cache(), head.make_lazy_cache()
    assert isinstance(lazy[0], LazyKVCache)
    for cycle in range(STEP // 2 + 10):  # grows past one STEP of capacity
        hidden = mx.random.normal((1, 3, size), key=mx.random.key(cycle))
        tokens = mx.array([[cycle % 50 + 3, 7, 11]], mx.int32)
        expected = head(hidden, tokens, eager)[0]
        got = head(hidden, tokens, lazy)[0]
        drop = cycle % 3
        eager[0].trim(drop)
        lazy[0].trim_lazily((got[0, 0, 0] * 0).astype(mx.int32) + drop)  # lazy, like a verdict
        assert mx.allclose(expected, got, atol=1e-5).item(), cycle
        lazy[0].settle(drop)
        assert lazy[0].bound == eager[0].offset
    assert lazy[0].offset.item() == eager[0].offset


def test_a_checkpoint_rolls_back_lazily_written_entries() -> None:
    cache = LazyKVCache()
    keys = mx.ones((1, 2, 4, 8))
    cache.update_and_fetch(keys, keys)
    point = cache.checkpoint()
    cache.update_and_fetch(2 * keys, 2 * keys)
    assert cache.bound == 8
    cache.rollback(point)
    assert cache.bound == 4 and cache.offset.item() == 4
    mask = cache.make_mask(2)
    assert mask.shape == (2, STEP)
    assert mask[0].sum().item() == 5 and mask[1].sum().item() == 6


def test_keeping_the_first_entries_is_advancing_then_trimming(head) -> None:
    """``keep_lazily`` from the offset before a write, with the count that holds still
    computing, leaves the offset (and the head's outputs after) that ``trim_lazily`` of the
    rest leaves, in one graph node."""
    size = head.trunk.hidden_size
    trimmed, kept = head.make_lazy_cache(), head.make_lazy_cache()
    for cycle in range(12):
        hidden = mx.random.normal((1, 3, size), key=mx.random.key(cycle))
        tokens = mx.array([[cycle % 50 + 3, 7, 11]], mx.int32)
        start = kept[0].offset
        want = head(hidden, tokens, trimmed)[0]
        got = head(hidden, tokens, kept)[0]
        assert mx.array_equal(want, got).item(), cycle
        holds = (got[0, 0, 0] * 0).astype(mx.int32) + 3 - cycle % 3  # lazy, like a verdict
        trimmed[0].trim_lazily(3 - holds)
        kept[0].keep_lazily(start, holds)
        assert kept[0].offset.item() == trimmed[0].offset.item()
        assert kept[0].bound == trimmed[0].bound
        for cache in (trimmed, kept):
            cache[0].settle(cycle % 3)
    assert kept[0].offset.item() == trimmed[0].offset.item() > 0
    mx.eval(start, holds)
    kept[0].keep_lazily(start, holds)
    graph = io.StringIO()
    mx.export_to_dot(graph, kept[0].offset)
    assert graph.getvalue().count("shape=rectangle") == 1
