"""Self-attention over ``SlotTarget``'s slot stores, group by group (``mtplx.models.slot_layout``):
in MLX ops over a group's padded ``[R, heads, T, L]`` layout, or in the fused C kernel
(``mtplx.attention``: per packed token and head, over that token's own keys).

The MLX-op attention is written so that a row's padding (shorter history, fewer tokens than
T_max) only appends exact zeros to its sums, which the invariant kernel ignores
(``mtplx/blas_invariant.c``): a row's bits never depend on the other rows of its group.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

from mtplx import attention as fused_attention
from mtplx.models.fused_projections import FusedProjections, fused_linear
from mtplx.models.kv_store import LayerKV
from mtplx.models.slot_layout import SlotGroup, padded

__all__ = ["group_attention", "kernel_attention", "layer_attention", "write_group"]


def layer_attention(
    attn: Any,
    x: mx.array,
    layer_index: int,
    groups: list[SlotGroup],
    positions: mx.array,
    fused: FusedProjections | None,
    kernel: bool,
    query_block: int,
) -> mx.array:
    """Self-attention of mlx-lm's llama Attention over the slot store, group by group.

    x: [1, N, H] packed -> [1, N, H]. The softmax is exp(s - max) normalised by a
    matmul with ones: both sums then run through the invariant kernel, to which the
    masked keys past a row's length are trailing zeros (MLX's own softmax would vectorise
    a longer row differently). ``kernel``: the fused kernel attends instead;
    ``query_block``: the most queries a product of the MLX-op attention takes per head.

    RoPE runs on the packed tokens (each its own batch entry at its own position), before
    they are spread to the groups' padded layout: the same values, without the pads, and
    queries and keys of a fused projection in one call."""
    heads, kv_heads = attn.n_heads, attn.n_kv_heads
    num_tokens = x.shape[1]
    if fused is None:
        queries_all = attn.q_proj(x)[0].reshape(num_tokens, heads, 1, -1)
        keys_all = attn.k_proj(x)[0].reshape(num_tokens, kv_heads, 1, -1)
        values_all = attn.v_proj(x)[0].reshape(num_tokens, kv_heads, 1, -1)
        queries_all = attn.rope(queries_all, offset=positions)
        keys_all = attn.rope(keys_all, offset=positions)
    else:
        qkv = fused_linear(x, fused.qkv, fused.qkv_bias)[0]
        k_end = fused.q_size + fused.kv_size
        roped = attn.rope(
            qkv[:, :k_end].reshape(num_tokens, heads + kv_heads, 1, -1), offset=positions
        )
        queries_all, keys_all = roped[:, :heads], roped[:, heads:]
        values_all = qkv[:, k_end:].reshape(num_tokens, kv_heads, 1, -1)
    attended = [
        group_attention(
            attn,
            queries_all,
            keys_all,
            values_all,
            group.store.layers[layer_index],
            group,
            kernel,
            query_block,
        )
        for group in groups
    ]
    return attn.o_proj((mx.concatenate(attended) if len(attended) > 1 else attended[0])[None])


def write_group(
    store: LayerKV,
    group: SlotGroup,
    keys_all: mx.array,
    values_all: mx.array,
    kv_heads: int,
) -> None:
    """Write a group's new keys and values ([N, kv, 1, d] of every packed token) at each
    row's positions (pads too: past the row's length, so never read). The store is updated
    in place (MLX donates its buffer) as long as nothing else holds it."""
    keys = padded(keys_all, group, kv_heads)
    values = padded(values_all, group, kv_heads)
    # Values carry a constant 1 as their last feature, so one product gives both the
    # weighted sum and the softmax's normaliser: a one-column product (the normaliser on
    # its own) is a matrix-vector call that bypasses the invariant kernel.
    values = mx.concatenate([values, _ones((*values.shape[:-1], 1), values.dtype)], -1)
    for name, new in (("keys", keys), ("values", values)):
        stored = getattr(store, name)
        width = stored.shape[-1]
        flat = stored.reshape(-1, width)
        flat[group.write_at] = new.reshape(-1, width)  # [R, kv, T, w]: write_at's order
        setattr(store, name, flat.reshape(stored.shape))


def group_attention(
    attn: Any,
    queries_all: mx.array,
    keys_all: mx.array,
    values_all: mx.array,
    store: LayerKV,
    group: SlotGroup,
    kernel: bool,
    query_block: int,
) -> mx.array:
    """One group: projections [N, heads, 1, d] of every packed token (queries and keys
    roped) -> [tokens, H]."""
    rows, tokens, keys_len = group.num_slots, group.max_tokens, group.key_length
    heads, kv_heads = attn.n_heads, attn.n_kv_heads
    repeats = heads // kv_heads

    write_group(store, group, keys_all, values_all, kv_heads)
    if kernel:
        return kernel_attention(attn, queries_all, store, group)
    queries = padded(queries_all, group, heads)
    head_dim = queries.shape[-1]
    # Read slots [first, first + R) up to L.
    window = slice(group.store_first, group.store_first + rows)
    all_keys = store.keys[window, :, :keys_len].transpose(0, 1, 3, 2)  # [R, kv, d, L]
    all_values = store.values[window, :, :keys_len]  # [R, kv, L, d+1]

    scaled = queries * attn.scale  # [R, heads, T, d]
    blocks = []
    for start in range(0, tokens, query_block):
        # Queries in blocks: each product has repeats x block rows, within the kernel.
        block = min(query_block, tokens - start)
        grouped = scaled[:, :, start : start + block].reshape(
            rows, kv_heads, repeats * block, head_dim
        )
        scores = grouped @ all_keys  # [R, kv, repeats * block, L]
        scores = scores.reshape(rows, kv_heads, repeats, block, keys_len)
        visible = group.mask[:, :, None, start : start + block]
        scores = mx.where(visible, scores, -mx.inf)
        weights = mx.exp(scores - mx.max(scores, axis=-1, keepdims=True))
        weights = weights.reshape(rows, kv_heads, repeats * block, keys_len)
        summed = weights @ all_values  # [R, kv, repeats * block, d+1]
        attended = summed[..., :head_dim] / summed[..., head_dim:]
        blocks.append(attended.reshape(rows, heads, block, head_dim))
    attended = mx.concatenate(blocks, axis=2) if len(blocks) > 1 else blocks[0]
    attended = attended.transpose(0, 2, 1, 3)  # [R, T, heads, d]
    attended = attended.reshape(rows * tokens, heads * head_dim)
    return attended if group.dense else attended[group.to_packed]


def kernel_attention(
    attn: Any, queries_all: mx.array, store: LayerKV, group: SlotGroup
) -> mx.array:
    """A group's attention in the fused kernel, straight from the packed queries
    ([N, heads, 1, d], roped) over the store (its new KV written): -> [tokens, H]."""
    assert group.slots is not None and group.counts is not None
    queries = queries_all
    if (group.start, group.end) != (0, queries_all.shape[0]):
        queries = queries_all[group.start : group.end]
    queries = queries.reshape(group.end - group.start, attn.n_heads, -1)
    return fused_attention.attend(
        queries, store.keys, store.values, group.slots, group.counts, attn.scale
    )


@functools.lru_cache(maxsize=64)
def _ones(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """An evaluated array of ones: a constant of the graph, where ``mx.ones`` would add two
    nodes to every layer of every forward."""
    ones = mx.ones(shape, dtype)
    mx.eval(ones)
    return ones
