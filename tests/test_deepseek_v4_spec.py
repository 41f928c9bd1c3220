"""The whole speculative loop on a tiny DeepSeek-V4-shaped checkpoint (mlx-lm's deepseek_v41
trunk with its ``mtp.*`` head): greedy output equals plain decoding, the head drafts through
caches that cannot be trimmed (sliding window + compressed KV), and sampling stays seeded."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtplx.engine import Engine
from mtplx.models import Tier, inspect, load
from mtplx.request import GenerationRequest, SamplerConfig, TokenEvent

GREEDY = SamplerConfig(temperature=0.0)
PROMPTS = [[5, 17, 33, 2, 9], [100, 101, 102, 100, 101, 102, 100], [7] * 12, [250, 3, 44, 91]]


@pytest.fixture(scope="module")
def engine(deepseek_v4_checkpoint: Path) -> Engine:
    return Engine(load(deepseek_v4_checkpoint))


def _tokens(engine: Engine, request: GenerationRequest) -> list[int]:
    return [e.token_id for e in engine.generate(request) if isinstance(e, TokenEvent)]


def test_deepseek_v4_checkpoint_is_served_by_its_mtp_head(
    engine: Engine, deepseek_v4_checkpoint: Path
) -> None:
    assert inspect(deepseek_v4_checkpoint).tier == Tier.UNVERIFIED
    assert engine.default_drafter == "mtp+ngram"
    assert not all(layer.is_trimmable() for layer in engine.model.target.make_cache())


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_deepseek_v4_greedy_speculative_equals_plain(engine: Engine, depth: int) -> None:
    for prompt in PROMPTS:
        plain = _tokens(engine, GenerationRequest(prompt, GREEDY, 40, drafter="none"))
        request = GenerationRequest(prompt, GREEDY, 40, drafter="mtp", depth=depth)
        assert _tokens(engine, request) == plain, (depth, prompt)


def test_deepseek_v4_adaptive_depth_and_ngram_equal_plain(engine: Engine) -> None:
    for prompt in PROMPTS:
        plain = _tokens(engine, GenerationRequest(prompt, GREEDY, 40, drafter="none"))
        assert _tokens(engine, GenerationRequest(prompt, GREEDY, 40)) == plain
        ngram = GenerationRequest(prompt, GREEDY, 40, drafter="ngram", depth=3)
        assert _tokens(engine, ngram) == plain


def test_deepseek_v4_seeded_sampling_replays(engine: Engine) -> None:
    config = SamplerConfig(temperature=0.8, top_k=40, seed=7)
    request = GenerationRequest(PROMPTS[0], config, 30, drafter="mtp", depth=2)
    assert _tokens(engine, request) == _tokens(engine, request)
