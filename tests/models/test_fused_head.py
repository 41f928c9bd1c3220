"""The generic MTP head on the fused CPU kernels (``mtplx.models.fused_head``): where the head
is served quantized on the CPU its llama layer runs on the trunk's fused halves, its attention
on the fused attention kernel over its own cache and the ops around it compiled, and every
output is bitwise what mlx-lm's layer gives with the same attention kernel in place of its
``scaled_dot_product_attention`` (the kernel's own NumPy twin is ``tests/test_attention.py``)
-- one row, many rows packed, a depth-3 draft chain -- in a fraction of the graph nodes."""

from __future__ import annotations

import collections
import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from mtplx import attention, fused_layer
from mtplx.drafters.base import DraftSampler
from mtplx.drafters.mtp import MTPDrafter
from mtplx.lazy_cache import LazyKVCache
from mtplx.models import LoadedModel, load, mtp_nextn
from mtplx.models.fused_head import fuse_head
from mtplx.models.mtp_nextn import NextNHead
from mtplx.request import SamplerConfig
from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.variants import quantize_checkpoint

NUM_ROWS = 16


@pytest.fixture(scope="module", params=["q4", "q4-draft-vocab", "q8"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny llama + generic head, its trunk quantized (so the loader quantizes the head
    to 8 bits); ``-draft-vocab``: the head has its own LM head over 128 tokens."""
    directory = tmp_path_factory.mktemp("mtp_nextn")
    draft_vocab = 128 if request.param.endswith("draft-vocab") else None
    build_checkpoint("llama_mtp", directory, draft_vocab=draft_vocab)
    quantize_checkpoint(directory, bits=int(request.param[1]), group_size=64)
    loaded = load(directory)
    fuse_head(loaded.mtp_heads[0])
    return loaded


def _head(model: LoadedModel) -> NextNHead:
    head = model.mtp_heads[0]
    assert isinstance(head, NextNHead)
    return head


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a).view(np.uint32)


def _hidden(model: LoadedModel, row: int, count: int, salt: int) -> mx.array:
    """[1, count, H] made-up target hidden states, different for every row and feed."""
    size = model.target.trunk.hidden_size
    return mx.random.normal((1, count, size), key=mx.random.key(1000 * row + salt)) * 3


def _tokens(row: int, count: int, salt: int) -> list[int]:
    return [(7 * row + 3 * i + salt) % 250 + 3 for i in range(count)]


def _kernel_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any = None,
    sinks: Any = None,
) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention`` as the fused head computes it: the attention
    kernel over the cache's whole buffers ([1, kv, capacity, d]), the T new queries [1,
    heads, T, d] (written at offset - T .. offset - 1) each seeing the keys up to its own
    position; the mask mlx-lm built is the same causal rule and is not read."""
    assert sinks is None
    heads, size, dim = queries.shape[1:]
    counts = cache.offset - size + 1 + mx.arange(size, dtype=mx.int32)
    out = attention.attend(
        queries[0].transpose(1, 0, 2),
        cache.keys,
        cache.values,
        mx.zeros((size,), mx.int32),
        counts,
        scale,
    )  # [T, heads * d]
    return out.reshape(size, heads, dim).transpose(1, 0, 2)[None]


def _run(head: NextNHead, fused: bool, fn: Any) -> Any:
    """``fn()`` on the head's fused path, or (``fused`` False) on mlx-lm's layer with the
    attention kernel as its attention (``_kernel_attention``), evaluated."""
    head.fuses_layer = fused
    saved = (llama.scaled_dot_product_attention, mtp_nextn.scaled_dot_product_attention)
    if not fused:
        llama.scaled_dot_product_attention = _kernel_attention
        mtp_nextn.scaled_dot_product_attention = _kernel_attention
    try:
        result = fn()
        mx.eval(result)
        return result
    finally:
        head.fuses_layer = True
        llama.scaled_dot_product_attention, mtp_nextn.scaled_dot_product_attention = saved


def test_the_quantized_head_runs_fused(model: LoadedModel) -> None:
    """On the CPU with the kernels built, the 8-bit head takes the fused path (the MTP
    drafter fuses the head it drafts with); switched off, it does not."""
    head = _head(model)
    assert fused_layer.available()
    assert head.fused_parts() is not None
    assert MTPDrafter(model).head is head and fuse_head(head)
    head.fuses_layer = False
    assert head.fused_parts() is None
    head.fuses_layer = True


def test_a_float_head_keeps_mlx_lm_layer(llama_mtp_checkpoint: Path) -> None:
    """A float32 head (its trunk float32) gets no fused parts: the kernels take quantized
    weights only."""
    head = _head(load(llama_mtp_checkpoint))
    assert not fuse_head(head)
    assert head.fused_parts() is None


@pytest.mark.parametrize("lazy", [False, True], ids=["kv-cache", "lazy-cache"])
def test_one_row_is_bitwise_mlx_lm_layer(model: LoadedModel, lazy: bool) -> None:
    """A prompt's pairs, then decode-sized feeds, over the head's cache: logits and hidden
    states of the fused head equal mlx-lm's layer's, bit for bit, at every feed."""
    head = _head(model)

    def feeds(fused: bool) -> list[tuple[mx.array, mx.array]]:
        cache = [LazyKVCache()] if lazy else head.make_cache()
        out = []
        for feed, size in enumerate([9, 1, 2, 3, 1, 6]):
            hidden = _hidden(model, 0, size, feed)
            tokens = mx.array([_tokens(0, size, feed)], mx.int32)
            out.append(_run(head, fused, lambda h=hidden, t=tokens: head(h, t, cache)))
        return out

    for (want_logits, want_hidden), (logits, hidden) in zip(feeds(False), feeds(True), strict=True):
        assert logits.shape == want_logits.shape
        np.testing.assert_array_equal(_bits(logits), _bits(want_logits))
        np.testing.assert_array_equal(_bits(hidden), _bits(want_hidden))


def test_packed_rows_are_bitwise_mlx_lm_layer(model: LoadedModel) -> None:
    """16 rows of different lengths over caches of different lengths (lazy and plain),
    packed into one forward: each row's outputs equal mlx-lm's layer's on the same rows."""
    head = _head(model)

    def feeds(fused: bool) -> list[list[tuple[mx.array, mx.array]]]:
        caches = [[LazyKVCache()] if row % 2 else head.make_cache() for row in range(NUM_ROWS)]
        out = []
        for feed in range(3):
            sizes = [1 + (row + feed) % 6 for row in range(NUM_ROWS)]
            if feed == 0:
                sizes = [2 + 3 * row for row in range(NUM_ROWS)]
            hidden = [_hidden(model, row, size, feed) for row, size in enumerate(sizes)]
            tokens = [mx.array([_tokens(row, n, feed)], mx.int32) for row, n in enumerate(sizes)]
            out.append(
                _run(head, fused, lambda h=hidden, t=tokens: head.forward_rows(h, t, caches))
            )
        return out

    for want_feed, got_feed in zip(feeds(False), feeds(True), strict=True):
        for row, ((want_logits, want_hidden), (logits, hidden)) in enumerate(
            zip(want_feed, got_feed, strict=True)
        ):
            np.testing.assert_array_equal(_bits(logits), _bits(want_logits), str(row))
            np.testing.assert_array_equal(_bits(hidden), _bits(want_hidden), str(row))


@pytest.mark.parametrize("num_rows", [1, NUM_ROWS])
def test_the_layer_node_is_bitwise_the_five_nodes(model: LoadedModel, num_rows: int) -> None:
    """Rows over lazy caches (a drafting cycle's), fed prompt-sized and decode-sized pairs,
    packed, with a lazy trim between feeds and the caches' growth past a capacity step: the
    layer as one node gives the five nodes' logits, hidden states, keys and values, bit
    for bit."""
    head = _head(model)

    def feeds(on: bool) -> tuple[list[Any], list[list[LazyKVCache]]]:
        caches = [[LazyKVCache()] for _ in range(num_rows)]
        out = []
        with _layer_node(head, on):
            for feed in range(4):
                sizes = [1 + (row + feed) % 4 for row in range(num_rows)]
                if feed == 0:
                    sizes = [5 + 17 * row for row in range(num_rows)]
                if feed == 2:
                    sizes = [250 + row for row in range(num_rows)]  # past the capacity step
                hidden = [_hidden(model, row, n, feed) for row, n in enumerate(sizes)]
                tokens = [
                    mx.array([_tokens(row, n, feed)], mx.int32) for row, n in enumerate(sizes)
                ]
                got = head.forward_rows(hidden, tokens, caches)
                mx.eval(got, [c[0].keys for c in caches], [c[0].values for c in caches])
                out.append(got)
                for row, cache in enumerate(caches):
                    cache[0].trim_lazily(mx.array(row % 2 + 1, mx.int32))
        return out, caches

    want, want_caches = feeds(False)
    got, got_caches = feeds(True)
    for want_feed, got_feed in zip(want, got, strict=True):
        for row, ((want_logits, want_hidden), (logits, hidden)) in enumerate(
            zip(want_feed, got_feed, strict=True)
        ):
            np.testing.assert_array_equal(_bits(logits), _bits(want_logits), str(row))
            np.testing.assert_array_equal(_bits(hidden), _bits(want_hidden), str(row))
    for row, (a, b) in enumerate(zip(want_caches, got_caches, strict=True)):
        assert int(a[0].offset) == int(b[0].offset) and a[0].bound == b[0].bound
        assert a[0].keys is not None and b[0].keys is not None
        assert a[0].values is not None and b[0].values is not None
        np.testing.assert_array_equal(_bits(b[0].keys), _bits(a[0].keys), str(row))
        np.testing.assert_array_equal(_bits(b[0].values), _bits(a[0].values), str(row))


@pytest.mark.parametrize("num_rows", [1, NUM_ROWS])
def test_logits_at_a_position_are_that_positions_bits(model: LoadedModel, num_rows: int) -> None:
    """``forward_rows`` asked for one position a row (lazy indices) projects those alone:
    each row's logits are bitwise that position's among all its positions' logits, its
    hidden states and cache the same as without ``at``."""
    head = _head(model)
    every = [[LazyKVCache()] for _ in range(num_rows)]
    only = [[LazyKVCache()] for _ in range(num_rows)]
    for feed in range(3):
        sizes = [1 + (row + feed) % 5 for row in range(num_rows)]
        hidden = [_hidden(model, row, size, feed) for row, size in enumerate(sizes)]
        tokens = [mx.array([_tokens(row, n, feed)], mx.int32) for row, n in enumerate(sizes)]
        # lazy [1] int32 positions, as the drafter's last valid pair's index is
        wanted = [(row * 7 + feed) % size for row, size in enumerate(sizes)]
        at = [mx.array(w + 1, mx.int32) - 1 for w in wanted]
        want = head.forward_rows(hidden, tokens, every)
        got = head.forward_rows(hidden, tokens, only, at=at)
        for row, ((want_logits, want_hidden), (logits, out)) in enumerate(
            zip(want, got, strict=True)
        ):
            assert logits.shape == (1, 1, want_logits.shape[-1])
            np.testing.assert_array_equal(
                _bits(logits[0, 0]), _bits(want_logits[0, wanted[row]]), str(row)
            )
            np.testing.assert_array_equal(_bits(out), _bits(want_hidden), str(row))
    for a, b in zip(every, only, strict=True):
        np.testing.assert_array_equal(_bits(a[0].keys), _bits(b[0].keys))


def _drafters(model: LoadedModel) -> list[MTPDrafter]:
    drafters = []
    for row in range(4):
        drafter = MTPDrafter(model)
        prompt = _tokens(row, 5 + 2 * row, 0)
        drafter.reset(prompt)
        drafter.commit([*prompt[1:], 5], _hidden(model, row, len(prompt), 0))
        drafters.append(drafter)
    return drafters


@pytest.mark.parametrize("layer_node", [True, False], ids=["layer-node", "five-nodes"])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_depth_three_chains_are_bitwise_mlx_lm_layer(
    model: LoadedModel, seeded: bool, layer_node: bool
) -> None:
    """Three cycles of depth-3 drafts (the head recursing on its own output twice a cycle;
    the second cycle's pairs committed lazily, then settled), four rows proposing together:
    every draft token and q equals the unfused head's, the fused layer one node or five."""
    head = _head(model)
    config = (
        SamplerConfig(temperature=0.8, top_p=0.95, seed=1)
        if seeded
        else SamplerConfig(temperature=0.0)
    )

    def cycles(fused: bool) -> list[tuple[list[mx.array], list[mx.array]]]:
        drafters = _drafters(model)
        out: list[tuple[list[mx.array], list[mx.array]]] = []
        for cycle in range(3):
            samplers = [
                DraftSampler(
                    config,
                    model.target.vocab_size,
                    mx.array(np.random.default_rng([row, cycle]).random(3, dtype=np.float32)),
                    None,
                    model.draft_vocab,
                )
                for row in range(len(drafters))
            ]
            histories = [_tokens(row, 8, cycle) for row in range(len(drafters))]
            proposals = _run(
                head,
                fused,
                lambda s=samplers, h=histories: drafters[0].propose_batch(
                    list(drafters), h, [3] * len(drafters), s
                ),
            )
            out.extend(proposals)
            for row, drafter in enumerate(drafters):
                if cycle == 1:  # fed by the next proposal with its count still lazy
                    tokens = mx.array(_tokens(row, 4, cycle), mx.int32)
                    drafter.commit_lazy(tokens, _hidden(model, row, 4, 20), mx.array(3))
                    continue
                if cycle == 2:
                    drafter.settle(1)
                drafter.commit(_tokens(row, 2, cycle), _hidden(model, row, 2, 10 + cycle))
        return out

    want_cycles = cycles(False)
    with _layer_node(head, layer_node):
        got_cycles = cycles(True)
    for (want_tokens, want_qs), (tokens, qs) in zip(want_cycles, got_cycles, strict=True):
        assert len(tokens) == len(want_tokens) == 3
        np.testing.assert_array_equal(np.array(mx.stack(tokens)), np.array(mx.stack(want_tokens)))
        for q, want in zip(qs, want_qs, strict=True):
            np.testing.assert_array_equal(_bits(q), _bits(want))


@contextlib.contextmanager
def _layer_node(head: NextNHead, on: bool) -> Iterator[None]:
    """The fused head's layer over lazy caches as one node (``on``) or as its five."""
    parts = head.fused_parts()
    assert parts is not None and parts.layer_node
    head.fused = parts._replace(layer_node=on)
    try:
        yield
    finally:
        head.fused = parts


def _nodes(head: NextNHead, fused: bool, path: Path) -> collections.Counter[str]:
    """The primitives of one decode-sized head step's graph (2 pairs over a fed cache)."""
    head.fuses_layer = fused
    try:
        cache = [LazyKVCache()]
        mx.eval(head(_hidden_like(head, 5, 0), mx.array([_tokens(1, 5, 0)], mx.int32), cache))
        logits, _ = head(_hidden_like(head, 2, 1), mx.array([_tokens(1, 2, 1)], mx.int32), cache)
        mx.export_to_dot(str(path), logits)
    finally:
        head.fuses_layer = True
    return collections.Counter(re.findall(r'label ="(\w+)"', path.read_text()))


def _hidden_like(head: NextNHead, count: int, salt: int) -> mx.array:
    return mx.random.normal((1, count, head.trunk.hidden_size), key=mx.random.key(salt))


def test_a_fused_step_is_a_fraction_of_the_nodes(model: LoadedModel, tmp_path: Path) -> None:
    """The fused step's layer over its lazy cache is one node (no separate product, norm,
    KV write or attention of the layer left; five without the layer node), and the whole
    step builds under half of mlx-lm's nodes."""
    head = _head(model)
    fused = _nodes(head, True, tmp_path / "fused.dot")
    unfused = _nodes(head, False, tmp_path / "unfused.dot")
    with _layer_node(head, False):
        five = _nodes(head, True, tmp_path / "five.dot")
    layer = ("MTPLXLayer", "MTPLXLayerBefore", "MTPLXKVWrite", "MTPLXStoreAttention")
    assert [fused[name] for name in layer] == [1, 0, 0, 0]
    assert [five[name] for name in layer] == [0, 1, 2, 1]
    assert fused["MTPLXLayerAfter"] == unfused["MTPLXLayerAfter"] == 0
    assert five["MTPLXLayerAfter"] == 1
    assert sum(five.values()) - sum(fused.values()) == 4
    assert unfused["MTPLXLayer"] == unfused["MTPLXLayerBefore"] == 0
    # The layer's seven products and two norms are inside them, fc and the two norms before
    # it in one input node: the LM head over every row and its norm are left.
    assert fused["MTPLXHeadInto"] == 1
    assert (fused["MTPLXQuantizedRows"], unfused["MTPLXQuantizedRows"]) == (1, 9)
    assert (fused["Square"], unfused["Square"]) == (1, 5)
    assert sum(fused.values()) * 2 < sum(unfused.values()), (fused, unfused)


def test_a_drafting_step_projects_in_its_output_node(model: LoadedModel, tmp_path: Path) -> None:
    """A drafting step (the logits of one position only) of a head with its own quantized
    LM head: the norm, the position's slice and the draft-vocabulary product are one output
    node, no norm or product left outside the kernels; a head projecting on the trunk's LM
    head keeps its norm and that product."""
    head = _head(model)
    cache = [LazyKVCache()]
    mx.eval(head(_hidden_like(head, 5, 0), mx.array([_tokens(1, 5, 0)], mx.int32), cache))
    ((logits, hidden),) = head.forward_rows(
        [_hidden_like(head, 2, 1)],
        [mx.array([_tokens(1, 2, 1)], mx.int32)],
        [cache],
        at=[mx.array(3, mx.int32) - 2],  # lazy, as a verdict's count is
    )
    path = tmp_path / "step.dot"
    mx.export_to_dot(str(path), logits, hidden)
    nodes = collections.Counter(re.findall(r'label ="(\w+)"', path.read_text()))
    assert nodes["MTPLXHeadInto"] == 1
    own = "lm_head" in head.module
    assert nodes["MTPLXHeadOut"] == int(own)
    assert (nodes["Square"], nodes["MTPLXQuantizedRows"]) == ((0, 0) if own else (1, 1))


def test_rope_angles_from_the_tables_are_the_computed_ones(model: LoadedModel) -> None:
    """The head takes its RoPE angles from tables by position: each position's cos and sin
    are bitwise what ``rope_tables`` computes for it alone or among others, at small and
    large positions, across the tables' growth."""
    parts = _head(model).fused_parts()
    assert parts is not None
    angles = type(parts.angles)(parts.angles.tables)
    ran = type(parts.angles)(parts.angles.tables)
    for start, size in [(0, 1), (5, 3), (1020, 9), (3000, 2), (4095, 1), (4090, 16)]:
        positions = mx.arange(start, start + size, dtype=mx.int32)
        cos, sin = angles.at(positions, start + size)
        want_cos, want_sin = parts.angles.tables(positions)
        np.testing.assert_array_equal(_bits(cos), _bits(want_cos.reshape(size, -1)))
        np.testing.assert_array_equal(_bits(sin), _bits(want_sin.reshape(size, -1)))
        for i in range(size):
            alone_cos, _ = parts.angles.tables(positions[i : i + 1])
            np.testing.assert_array_equal(_bits(cos[i]), _bits(alone_cos.reshape(-1)))
        # a run from a lazy start (a drafting cycle's offset) is the same slice of the tables
        run_cos, run_sin = ran.run(mx.array(start + 1, mx.int32) - 1, size, start + size)
        np.testing.assert_array_equal(_bits(run_cos), _bits(cos))
        np.testing.assert_array_equal(_bits(run_sin), _bits(sin))
    assert angles.size == ran.size == 5 * angles.GROWTH  # grown in steps to cover 4105
