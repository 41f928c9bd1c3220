"""The price of a prompt chunk: exact integer arithmetic against a plain sum over its
positions, the largest affordable chunk against a search of every size, and a token's
price from a checkpoint's sizes."""

from __future__ import annotations

import itertools

import pytest

from mtplx.prefill_cost import (
    DEFAULT_KEYS_PER_TOKEN,
    affordable_tokens,
    chunk_cost,
    keys_per_token,
)

SMOLLM2_135M = {
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
}


def _reference_cost(context: int, size: int, per_token: int) -> int:
    """Each fed token: its products, and one key for every position up to its own."""
    return sum(per_token + context + position for position in range(1, size + 1))


def test_a_chunk_costs_its_products_and_each_tokens_keys() -> None:
    for context, size, per_token in itertools.product((0, 1, 31, 4000), (0, 1, 2, 32), (1, 2048)):
        assert chunk_cost(context, size, per_token) == _reference_cost(context, size, per_token)
    # Deeper chunks cost more: 32 tokens 4,000 positions deep, about three times as much.
    assert chunk_cost(4000, 32, 2048) > 2.9 * chunk_cost(0, 32, 2048)


@pytest.mark.parametrize("context", [0, 7, 1000, 6000])
@pytest.mark.parametrize("budget", [0, 100, 2048, 2049 + 6000, 50_000, 262_144])
def test_the_affordable_chunk_is_the_largest_within_the_budget(context: int, budget: int) -> None:
    for most in (0, 1, 32, 384):
        fits = [n for n in range(most + 1) if _reference_cost(context, n, 2048) <= budget]
        assert affordable_tokens(context, budget, 2048, most) == max(fits)


def test_a_token_is_priced_from_the_checkpoints_sizes() -> None:
    # Per layer: 576 x 64 x (2 x 9 + 2 x 3) projection and 3 x 576 x 1536 MLP multiply-adds
    # a token, 2 x 9 x 64 a key; an attention multiply-add at 1.5 a product's.
    assert keys_per_token(SMOLLM2_135M) == 2048
    assert keys_per_token({**SMOLLM2_135M, "head_dim": 64}) == 2048
    # A multimodal checkpoint's trunk sizes; a mixture of experts: the routed experts' width.
    assert keys_per_token({"text_config": SMOLLM2_135M}) == 2048
    moe = {**SMOLLM2_135M, "num_experts_per_tok": 2, "moe_intermediate_size": 768}
    assert keys_per_token(moe) == 2048
    wider = keys_per_token({**SMOLLM2_135M, "intermediate_size": 3072})
    assert wider > 2048
    assert keys_per_token({"hidden_size": 576}) == DEFAULT_KEYS_PER_TOKEN
    assert keys_per_token({**SMOLLM2_135M, "num_attention_heads": 0}) == DEFAULT_KEYS_PER_TOKEN
