"""What a prompt chunk costs a step, for the budget prompts share beside decoding streams.

A chunk's products cost the same per token at any depth, but its attention grows with the
context before it: each of its tokens attends over every key before it and itself. In
units of one attention key (one query over one cached position, all layers and heads), a
chunk of ``size`` tokens after ``context`` positions costs

    size * keys_per_token + sum(context + i for i in 1..size)

where ``keys_per_token`` is how many keys cost as much as one token's products. It is
priced from the model's shape (multiply-adds of a token's products over those of one key)
and ``ATTENTION_MAC_COST``, what an attention multiply-add costs against a product's on
the CPU kernels (the scores' exp and running max, float32 against the products' int8;
measured: ``benchmarks/results/2026-12-03-beside-long-prompts/``). Pure integer
arithmetic: the schedule's choices are the same on every run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "ATTENTION_MAC_COST",
    "DEFAULT_KEYS_PER_TOKEN",
    "affordable_tokens",
    "chunk_cost",
    "keys_per_token",
]

# An attention multiply-add (score or weighted sum) costs this many product multiply-adds.
ATTENTION_MAC_COST = 1.5
# Where the configuration does not say enough to price a token: the default model's price.
DEFAULT_KEYS_PER_TOKEN = 2048


def keys_per_token(config: Mapping[str, Any]) -> int:
    """How many attention keys cost as much as one token's products, for a model of
    ``config`` (a checkpoint's config.json): per layer, a token's product multiply-adds
    (attention projections and MLP) over the ``2 x heads x head_dim`` multiply-adds a
    query spends on one key (score and weighted sum), over ``ATTENTION_MAC_COST``.
    ``DEFAULT_KEYS_PER_TOKEN`` when the configuration lacks a size."""
    text = config.get("text_config")
    if isinstance(text, Mapping):  # multimodal checkpoints keep the trunk's sizes there
        config = {**config, **text}
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        mlp = _mlp_width(config)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return DEFAULT_KEYS_PER_TOKEN
    products = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * mlp
    per_key = 2 * heads * head_dim
    if per_key <= 0 or products <= 0:
        return DEFAULT_KEYS_PER_TOKEN
    return max(1, round(products / per_key / ATTENTION_MAC_COST))


def _mlp_width(config: Mapping[str, Any]) -> int:
    """The MLP width a token goes through: the experts it is routed to (and the shared
    ones) in a mixture-of-experts layer, else ``intermediate_size``."""
    experts = config.get("num_experts_per_tok")
    width = config.get("moe_intermediate_size")
    if experts and width:
        shared = int(config.get("n_shared_experts") or 0)
        return (int(experts) + shared) * int(width)
    return int(config["intermediate_size"])


def chunk_cost(context: int, size: int, keys_per_token: int) -> int:
    """The cost, in attention keys, of feeding ``size`` prompt tokens after ``context``
    positions (see the module docstring)."""
    return size * (keys_per_token + context) + size * (size + 1) // 2


def affordable_tokens(context: int, budget: int, keys_per_token: int, most: int) -> int:
    """The most tokens, at most ``most``, a prompt ``context`` positions deep can feed
    within ``budget`` keys (0 when not even one fits)."""
    low, high = 0, max(most, 0)
    while low < high:  # the largest n with chunk_cost(n) <= budget (cost grows with n)
        middle = (low + high + 1) // 2
        if chunk_cost(context, middle, keys_per_token) <= budget:
            low = middle
        else:
            high = middle - 1
    return low
