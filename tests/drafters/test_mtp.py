"""The MTP drafter over many rows at once: one head forward a depth for every drafting row,
and each row's drafts (tokens and q) bitwise what it drafts alone."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtplx.drafters.base import DraftSampler
from mtplx.drafters.mtp import CATCH_UP_CHUNK, MTPDrafter
from mtplx.models import LoadedModel, load
from mtplx.models.fused_head import fuse_head
from mtplx.request import SamplerConfig
from tests.fixtures.variants import quantize_checkpoint

NUM_ROWS = 16


@pytest.fixture(scope="module", params=["float32", "q4"])
def model(
    request: pytest.FixtureRequest,
    llama_mtp_checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> LoadedModel:
    """The tiny llama + generic head; ``q4``: its trunk quantized, so the head is served
    8-bit and runs on the fused kernels (``mtplx.models.fused_head``)."""
    if request.param == "float32":
        return load(llama_mtp_checkpoint)
    directory = tmp_path_factory.mktemp("mtp_q4") / "model"
    shutil.copytree(llama_mtp_checkpoint, directory)
    quantize_checkpoint(directory, bits=4, group_size=64)
    loaded = load(directory)
    assert fuse_head(loaded.mtp_heads[0])  # as the drafters do: the head alone too
    return loaded


def _hidden(model: LoadedModel, row: int, count: int, salt: int) -> mx.array:
    """[1, count, H] made-up target hidden states, different for every row and feed."""
    size = model.target.trunk.hidden_size
    return mx.random.normal((1, count, size), key=mx.random.key(1000 * row + salt))


def _tokens(row: int, count: int, salt: int) -> list[int]:
    return [(7 * row + 3 * i + salt) % 50 + 3 for i in range(count)]


def test_forward_rows_gives_each_row_its_alone_outputs(model: LoadedModel) -> None:
    """16 rows of different lengths over caches of different lengths, packed: each row's
    logits and hidden states equal a call of the head on that row alone, bit for bit."""
    head = model.mtp_heads[0]
    alone = [head.make_cache() for _ in range(NUM_ROWS)]
    packed = [head.make_cache() for _ in range(NUM_ROWS)]
    for feed in range(3):
        sizes = [1 + (row + feed) % 6 for row in range(NUM_ROWS)]
        if feed == 0:  # a prompt's worth of pairs for some rows first
            sizes = [8 + 5 * row for row in range(NUM_ROWS)]
        hidden = [_hidden(model, row, size, feed) for row, size in enumerate(sizes)]
        tokens = [mx.array([_tokens(row, size, feed)], mx.int32) for row, size in enumerate(sizes)]
        expected = [head(h, t, c) for h, t, c in zip(hidden, tokens, alone, strict=True)]
        got = head.forward_rows(hidden, tokens, packed)
        for row, ((want_logits, want_hidden), (logits, out)) in enumerate(
            zip(expected, got, strict=True)
        ):
            assert logits.shape == want_logits.shape
            np.testing.assert_array_equal(np.array(logits), np.array(want_logits), str(row))
            np.testing.assert_array_equal(np.array(out), np.array(want_hidden), str(row))


def _assert_logits_at(model: LoadedModel) -> None:
    """16 rows, one position a row asked for (lazy indices): each row's logits are
    bitwise that position's among all its positions', its hidden states the same."""
    head = model.mtp_heads[0]
    every = [head.make_cache() for _ in range(NUM_ROWS)]
    only = [head.make_cache() for _ in range(NUM_ROWS)]
    for feed in range(2):
        sizes = [1 + (row + feed) % 4 for row in range(NUM_ROWS)]
        hidden = [_hidden(model, row, size, feed) for row, size in enumerate(sizes)]
        tokens = [mx.array([_tokens(row, size, feed)], mx.int32) for row, size in enumerate(sizes)]
        wanted = [(3 * row + feed) % size for row, size in enumerate(sizes)]
        at = [mx.array(w + 1, mx.int32) - 1 for w in wanted]  # lazy, as the drafter's
        want = head.forward_rows(hidden, tokens, every)
        got = head.forward_rows(hidden, tokens, only, at=at)
        for row, ((want_logits, want_hidden), (logits, out)) in enumerate(
            zip(want, got, strict=True)
        ):
            assert logits.shape == (1, 1, want_logits.shape[-1])
            np.testing.assert_array_equal(
                np.array(logits[0, 0]), np.array(want_logits[0, wanted[row]]), str(row)
            )
            np.testing.assert_array_equal(np.array(out), np.array(want_hidden), str(row))


def test_forward_rows_at_gives_that_positions_logits(model: LoadedModel) -> None:
    """The generic head, float and fused (``MTPHead.forward_rows``'s ``at``)."""
    _assert_logits_at(model)


def _drafters(model: LoadedModel) -> list[MTPDrafter]:
    """NUM_ROWS drafters, each fed its own committed history (lazy caches: the engine's)."""
    drafters = []
    for row in range(NUM_ROWS):
        drafter = MTPDrafter(model)
        prompt = _tokens(row, 4 + row, 0)
        drafter.reset(prompt)
        drafter.commit([*prompt[1:], 5], _hidden(model, row, len(prompt), 0))
        drafters.append(drafter)
    return drafters


def _sampler(model: LoadedModel, row: int, seeded: bool, depth: int, cycle: int) -> DraftSampler:
    config = (
        SamplerConfig(temperature=0.8, top_p=0.95, seed=row)
        if seeded
        else SamplerConfig(temperature=0.0)
    )
    uniforms = mx.array(np.random.default_rng([row, cycle]).random(depth, dtype=np.float32))
    return DraftSampler(config, model.target.vocab_size, uniforms, None, model.draft_vocab)


def _assert_batch_drafts_alone(
    model: LoadedModel, alone: list, batched: list, cycle: int, seeded: bool
) -> None:
    """One cycle at depths 0..4 by row: every row's draft tokens and q from one batched
    proposal equal its proposal alone (``alone``), bitwise."""
    depths = [(row + cycle) % 5 for row in range(NUM_ROWS)]
    histories = [_tokens(row, 8, cycle) for row in range(NUM_ROWS)]
    expected = [
        d.propose(h, k, _sampler(model, row, seeded, k, cycle))
        for row, (d, h, k) in enumerate(zip(alone, histories, depths, strict=True))
    ]
    samplers = [_sampler(model, row, seeded, k, cycle) for row, k in enumerate(depths)]
    got = batched[0].propose_batch(list(batched), histories, depths, samplers)
    for row, ((want_tokens, want_qs), (tokens, qs)) in enumerate(zip(expected, got, strict=True)):
        assert len(tokens) == len(want_tokens) == depths[row]
        np.testing.assert_array_equal(
            np.array(mx.stack(tokens)) if tokens else [],
            np.array(mx.stack(want_tokens)) if want_tokens else [],
            str(row),
        )
        for q, want in zip(qs, want_qs, strict=True):
            np.testing.assert_array_equal(np.array(q), np.array(want), str(row))


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_a_row_drafts_alone_what_it_drafts_among_sixteen(model: LoadedModel, seeded: bool) -> None:
    """Three cycles of depths 0..4 (the second cycle's pairs committed lazily and fed with
    their count unread, then settled): every row's draft tokens and q from one batched
    proposal equal its proposal alone, bitwise; rows that draft nothing this cycle keep
    their pairs queued."""
    alone, batched = _drafters(model), _drafters(model)
    for cycle in range(3):
        _assert_batch_drafts_alone(model, alone, batched, cycle, seeded)
        for row in range(NUM_ROWS):  # the cycle's verdict: two of three pairs hold
            for drafters in (alone, batched):
                drafter = drafters[row]
                assert drafter.commits_lazily
                if cycle == 1:  # fed by the next proposal with its count still lazy
                    tokens = mx.array(_tokens(row, 3, cycle), mx.int32)
                    drafter.commit_lazy(tokens, _hidden(model, row, 3, 20), mx.array(2))
                    continue
                if cycle == 2:  # the lazy commit's verdict is read: one pair rejected
                    drafter.settle(1)
                drafter.commit(_tokens(row, 2, cycle), _hidden(model, row, 2, 10 + cycle))


@pytest.mark.parametrize("valid", [1, 2, 3])
def test_a_lazy_commit_drafts_what_its_valid_pairs_draft(model: LoadedModel, valid: int) -> None:
    """Pairs committed lazily with ``valid`` of them holding (the count unread when the
    next proposal feeds them) draft what committing those pairs alone drafts, bitwise:
    the draft is read at the last valid pair, whichever it is."""
    lazy, eager = _drafters(model)[:2], _drafters(model)[:2]
    tokens, hidden = _tokens(0, 3, 1), _hidden(model, 0, 3, 30)
    lazy[0].commit_lazy(mx.array(tokens, mx.int32), hidden, mx.array(valid + 1) - 1)
    eager[0].commit(tokens[:valid], hidden[:, :valid])
    for drafter in (lazy[1], eager[1]):  # the same rows fed first (2 pairs) for a fuller cache
        drafter.commit(_tokens(1, 2, 1), _hidden(model, 1, 2, 31))
    for drafters in (lazy, eager):
        samplers = [_sampler(model, row, False, 2, 1) for row in range(2)]
        drafts = drafters[0].propose_batch(drafters, [[0], [0]], [2, 2], samplers)
        if drafters is lazy:
            want = drafts
    for (tokens_got, qs_got), (tokens_want, qs_want) in zip(drafts, want, strict=True):
        np.testing.assert_array_equal(
            np.array(mx.stack(tokens_got)), np.array(mx.stack(tokens_want))
        )
        for q, q_want in zip(qs_got, qs_want, strict=True):
            np.testing.assert_array_equal(np.array(q), np.array(q_want))


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_a_long_prompt_reaches_the_head_in_chunks(
    model: LoadedModel, seeded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt's pairs queued at once reach the head's cache at most CATCH_UP_CHUNK a
    forward, and the drafts equal those of the same pairs committed and fed a chunk at a
    time by proposals of their own, bitwise."""
    count = 2 * CATCH_UP_CHUNK + 37
    prompt, hidden = _tokens(0, count, 0), _hidden(model, 0, count, 0)
    head = model.mtp_heads[0]
    sizes: list[int] = []
    forward_rows = head.forward_rows

    def recorded(
        hiddens: list[mx.array], tokens: list[mx.array], caches: list, at: list | None = None
    ) -> list:
        sizes.extend(int(t.shape[1]) for t in tokens)
        return forward_rows(hiddens, tokens, caches, at=at)

    monkeypatch.setattr(head, "forward_rows", recorded)
    at_once = MTPDrafter(model)
    at_once.reset(prompt)
    at_once.commit([*prompt[1:], 5], hidden)
    want_tokens, want_qs = at_once.propose(prompt, 3, _sampler(model, 0, seeded, 3, 0))
    assert max(sizes) == CATCH_UP_CHUNK and sum(sizes) == count + 2
    chunked = MTPDrafter(model)
    chunked.reset(prompt)
    pairs = [*prompt[1:], 5]
    for start in range(0, count, CATCH_UP_CHUNK):
        end = min(start + CATCH_UP_CHUNK, count)
        chunked.commit(pairs[start:end], hidden[:, start:end])
        if end < count:
            chunked.propose(prompt, 1, _sampler(model, 0, seeded, 1, 0))
    tokens, qs = chunked.propose(prompt, 3, _sampler(model, 0, seeded, 3, 0))
    np.testing.assert_array_equal(np.array(mx.stack(tokens)), np.array(mx.stack(want_tokens)))
    for q, want in zip(qs, want_qs, strict=True):
        np.testing.assert_array_equal(np.array(q), np.array(want))


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v4"])
def deepseek(request: pytest.FixtureRequest) -> LoadedModel:
    """The DeepSeek-form heads (MLA or window attention, MoE): caches not lazy."""
    return load(request.getfixturevalue(f"{request.param}_checkpoint"))


def _deepseek_drafters(model: LoadedModel) -> list[MTPDrafter]:
    """NUM_ROWS drafters, each fed its own committed history."""
    drafters = []
    size = model.target.hidden_size
    for row in range(NUM_ROWS):
        drafter = MTPDrafter(model)
        prompt = _tokens(row, 4 + row, 0)
        drafter.reset(prompt)
        hidden = mx.random.normal((1, len(prompt), size), key=mx.random.key(row))
        drafter.commit([*prompt[1:], 5], hidden)
        drafters.append(drafter)
    return drafters


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_a_deepseek_head_row_drafts_alone_what_it_drafts_among_sixteen(
    deepseek: LoadedModel, seeded: bool
) -> None:
    """The DeepSeek-form heads pack rows too: three cycles of depths 0..4, each row's draft
    tokens and q from one batched proposal equal its proposal alone, bitwise."""
    model = deepseek
    size = model.target.hidden_size
    alone, batched = _deepseek_drafters(model), _deepseek_drafters(model)
    assert not alone[0].commits_lazily
    for cycle in range(3):
        _assert_batch_drafts_alone(model, alone, batched, cycle, seeded)
        for row in range(NUM_ROWS):  # the cycle's verdict: two pairs committed
            hidden = mx.random.normal((1, 2, size), key=mx.random.key(100 * cycle + row))
            for drafters in (alone, batched):
                drafters[row].commit(_tokens(row, 2, cycle), hidden)


def test_a_deepseek_head_gives_the_logits_at_a_position(deepseek: LoadedModel) -> None:
    """The DeepSeek-form heads take ``at`` too (their logits of every position, taken)."""
    _assert_logits_at(deepseek)
