"""The engine's MTP drafts equal an offline replay of the head on the same text: the drafter
is fed exactly the pairs (h[m], x[m+1]) of a plain forward, through drafting cycles, plain
(adaptive) cycles and prefix-cache hits, and drafts token for token what the replay drafts."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtplx.models import load
from mtplx.train.compare import compare_prompt, prompt_messages, recording_engine

PROMPTS = ([5, 9, 14, 3, 77, 120, 6], [200, 3, 3, 41, 8, 8, 19, 250, 4, 60, 61, 62])
LONG = [(31 * j * j + 7 * j + 11) % 250 + 3 for j in range(37)]  # two full cache blocks


@pytest.fixture(scope="module")
def model(llama_draft_vocab_checkpoint: Path):
    return load(llama_draft_vocab_checkpoint)


def _assert_same(result: dict) -> None:
    assert result["fed_pairs_ok"]
    assert result["fed_hidden_max_diff"] < 1e-3
    assert result["engine_cycles"] > 0
    assert result["draft_mismatches"] == 0


@pytest.mark.parametrize("depth", [1, 3])
def test_fixed_depth_drafts_equal_the_replay(model, depth: int) -> None:
    for prompt in PROMPTS:
        result = compare_prompt(model, prompt, depth, 40)
        _assert_same(result)
        # Same drafts on the same text: the same acceptance, position by position.
        engine = result["engine_accepted"] + [0] * depth
        assert engine[:depth] == result["replay_accepted"]
        assert result["engine_drafted"] == result["replay_drafted"]


def test_adaptive_and_prefix_cache_feed_the_same_pairs(model) -> None:
    engine = recording_engine(model, prefix_cache_bytes=1 << 24, prefill_chunk_size=4)
    for _ in range(2):  # the second run reads the prompt's hidden states from the cache
        for prompt in (PROMPTS[0], LONG):
            _assert_same(compare_prompt(model, prompt, 3, 40, engine=engine, engine_depth=None))
    assert engine.prefix_cache.stats.hits > 0


def test_prompt_sets() -> None:
    from mtplx.train.prompts import build_prompts
    from mtplx.train.prompts_broad import build_broad_prompts

    broad = prompt_messages("broad", 30)
    _, held = build_broad_prompts(0)
    assert broad == [(p.text, p.history) for p in held[:30]]
    assert any(history for _, history in broad)
    assert prompt_messages("heldout", 5) == [(p.text, ()) for p in build_prompts(0)[1][:5]]
    bench = prompt_messages("benchmarks", 4)
    assert len(bench) == 4 and all(not history for _, history in bench)
