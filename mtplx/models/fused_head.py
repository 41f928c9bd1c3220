"""The generic MTP head's step on the trunk's fused CPU kernels: same bits, fewer nodes.

A head step over mlx-lm's llama layer is ~220 graph nodes on MLX's CPU backend (nine
separate quantized products, five RMSNorms of ~6 ops each, RoPE in the layer, the quantized
embedding lookup, attention, SwiGLU), as many as the whole fused trunk's forward, and every
node costs dispatch on the engine thread. Where the head is served quantized on the CPU,
``fuse_head`` gives it (``NextNHead.fused``):

- its layer's halves on the fused kernels (``mtplx.fused_layer``: ``before`` = input norm,
  fused q/k/v, RoPE; ``after`` = o_proj, residual, norm, fused gate/up, SwiGLU, down,
  residual), with the trunk's own stacking of q/k/v and gate/up and its hoisted RoPE
  angles; over lazy caches (a drafting cycle's) the whole layer, its KV writes and
  attention included, is one node (``fused_layer.layer``, the trunk's layer node: the same
  C functions in the same order, so the same bits);
- its attention over its own cache on the fused attention kernel (``mtplx.attention``),
  the cache's buffers read as a store of one slot: a handful of nodes instead of mlx-lm's
  mask and ~20 attention ops. The kernel's vectorised ``exp`` gives other bits than MLX's,
  so the head's drafts differ from mlx-lm's layer's; what speculative decoding outputs does
  not (the acceptance rule is exact whatever the drafts), and the kernel is as
  batch-invariant as the rest (a token's result depends on its query, its row's keys and
  its count only);
- the ops before the layer (the two input norms, their concatenation, fc) and after it
  (norm, the head's own quantized LM head over the rows whose logits are wanted) as one
  kernel node each (``fused_layer.head_into`` / ``head_out``), compiled MLX functions where
  fc or the LM head is a float layer or the trunk's.

Every output is bitwise mlx-lm's layer's with the attention kernel in place of its
``scaled_dot_product_attention`` (``tests/test_models_fused_head.py``). It lives
outside ``mtp_nextn`` so that the model loader's modules do not import the kernels' modules
(which import the models package); the MTP drafter fuses the head it drafts with.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from mtplx import attention, fused_layer
from mtplx.lazy_cache import LazyKVCache
from mtplx.models.base import positions
from mtplx.models.compiled_layer import CompiledLayer
from mtplx.models.fused_projections import fuse_projections
from mtplx.models.mtp_nextn import NextNHead, NextNModule, _packs
from mtplx.models.quantized import (
    InvariantQuantizedLinear,
    QuantWeight,
    linear_kind,
    weight_arrays,
    weight_kind,
    weight_of,
)
from mtplx.models.target import Trunk

__all__ = ["FusedHead", "RopeAngles", "fuse_head"]


def fuse_head(head: Any) -> bool:
    """Give a generic MTP head (``NextNHead``) its fused step where the kernels serve it
    (see the module docstring); whether it has one. Idempotent; other heads are left as
    they are."""
    if not isinstance(head, NextNHead):
        return False
    if not head.fuse_checked:
        head.fused = _fuse_head(head.module, head.index, head.trunk)
        head.fuse_checked = True
    return head.fused is not None


class FusedHead(NamedTuple):
    """A head step as the trunk's quantized CPU path runs its layers: the decoder layer's
    halves on the fused kernels (``mtplx.fused_layer``: ``before`` = input norm, the fused
    q/k/v product, RoPE; ``after`` = o_proj, residual, post-attention norm, fused gate/up,
    SwiGLU, down, residual), attention over the head's own cache on the attention kernel,
    and the norms, fc and head projection around it one node each (``into``, ``out_at``;
    compiled where not quantized): ~20 graph nodes a drafting step instead of mlx-lm's
    ~220."""

    qkv: QuantWeight  # [q | k | v] rows
    o_proj: QuantWeight
    gate_up: QuantWeight  # [gate | up] rows
    down: QuantWeight
    angles: RopeAngles  # the RoPE angles of the fed positions, from a table by position
    # (tokens [1, N], hidden [1, N, H]) -> fc(concat(norm_e(embed(tokens)), norm_h(hidden)))
    into: Callable[[mx.array, mx.array], mx.array]
    # x [1, N, H] -> (logits [1, N, V'] or None for the trunk's head, norm(x) [1, N, H])
    out: Callable[[mx.array], tuple[mx.array | None, mx.array]]
    # (x [1, N, H], rows [R] or [] int32) -> (logits [1, R or 1, V'] of those rows or None,
    # norm(x))
    out_at: Callable[[mx.array, mx.array], tuple[mx.array | None, mx.array]]
    block: Any  # the head's mlx-lm llama layer (its norms' weights, attention settings)
    weights: fused_layer.PreparedLayer  # the layer's weights as the one-node layer takes them
    # Rows over lazy caches (a drafting cycle's) run the layer as one node
    # (``fused_layer.layer``) where True, as its five (halves, two writes, attention) where
    # False: the same C functions in the same order, so the same bits (``MTPLX_LAYER_NODE``,
    # as the trunk's layers).
    layer_node: bool = True

    def layer(self, x: mx.array, sizes: list[int], caches: list[list[Any]]) -> mx.array:
        """The layer over packed rows x [1, N, H] -> [1, N, H] (``_fused_rows``)."""
        return _fused_rows(self, self.block, x, sizes, caches)


def _plain(module: Any) -> bool:
    """A bias-free float or kernel-quantized linear layer."""
    return type(module) in (nn.Linear, InvariantQuantizedLinear) and "bias" not in module


def _fuse_head(module: NextNModule, index: int, trunk: Trunk) -> FusedHead | None:
    """The fused parts of head ``index``, or None unless the kernels serve here (CPU,
    extension built), its layer is mlx-lm's llama block with every projection on the
    quantized kernel, no biases, and mlx's plain RoPE (what the trunk's fused path takes),
    and its norms, fc and own head (if any) are plain RMSNorm / linear layers."""
    layer = module.layers[index]
    if not _packs(layer) or not fused_layer.available() or not attention.available():
        return None
    attn, mlp = layer.self_attn, layer.mlp
    projections = (
        attn.q_proj,
        attn.k_proj,
        attn.v_proj,
        attn.o_proj,
        mlp.gate_proj,
        mlp.up_proj,
        mlp.down_proj,
    )
    if not all(type(p) is InvariantQuantizedLinear and "bias" not in p for p in projections):
        return None
    norms = (module.pre_fc_norm_embedding, module.pre_fc_norm_hidden, module.norm)
    own_head = module.lm_head if "lm_head" in module else None
    if any(type(n) is not nn.RMSNorm for n in norms) or not _plain(module.fc):
        return None
    if own_head is not None and not _plain(own_head):
        return None
    # Stacks q/k/v and gate/up as the trunk's layers are (exact: output rows are quantized
    # independently) and leaves the modules on views of the stacked arrays.
    fused = fuse_projections(layer)
    if fused is None:
        return None
    compiled = CompiledLayer.for_trunk([layer], [fused])
    o_proj, down = weight_of(attn.o_proj), weight_of(mlp.down_proj)
    if (
        compiled is None
        or not compiled.hoists_rope
        or not isinstance(fused.qkv, QuantWeight)
        or not isinstance(fused.gate_up, QuantWeight)
        or not isinstance(o_proj, QuantWeight)
        or not isinstance(down, QuantWeight)
    ):
        return None
    into, out, out_at = _compiled_ends(module, trunk)
    angles = RopeAngles(compiled.rope_tables)
    norm, post = layer.input_layernorm, layer.post_attention_layernorm
    weights = fused_layer.LayerWeights(
        norm.weight,
        fused.qkv,
        attn.n_heads,
        attn.n_kv_heads,
        attn.head_dim,
        attn.rope.dims,
        float(norm.eps),
        float(attn.scale),
        o_proj,
        post.weight,
        fused.gate_up,
        down,
        float(post.eps),
    )
    layer_node = os.environ.get("MTPLX_LAYER_NODE", "1").strip().lower() not in ("0", "off", "no")
    return FusedHead(
        fused.qkv, o_proj, fused.gate_up, down, angles, into, out, out_at, layer,
        fused_layer.prepare(weights), layer_node,
    )  # fmt: skip


def _compiled_ends(
    module: NextNModule, trunk: Trunk
) -> tuple[
    Callable[[mx.array, mx.array], mx.array],
    Callable[[mx.array], tuple[mx.array | None, mx.array]],
    Callable[[mx.array, mx.array], tuple[mx.array | None, mx.array]],
]:
    """The head step's ops before its layer (embedding lookup, the two norms, fc) and after it
    (norm, the head's own LM head: over every row, or over the rows asked for only): with
    fc quantized, the lookup and one kernel node for the rest (``fused_layer.head_into``:
    MLX's norms, the invariant product); else compiled (the same ops in the same order:
    MLX's fusion of elementwise ops changes no bits), the trunk's embedding read as the
    compiled function's constant and the head's weights as its arguments."""
    norm_e, norm_h = module.pre_fc_norm_embedding, module.pre_fc_norm_hidden
    fc = weight_of(module.fc)
    fc_kind = weight_kind(fc)

    def into(
        tokens: mx.array, hidden: mx.array, w_e: mx.array, w_h: mx.array, fc_arrays: Any
    ) -> mx.array:
        joined = mx.concatenate(
            [
                mx.fast.rms_norm(trunk.embed(tokens), w_e, norm_e.eps),
                mx.fast.rms_norm(hidden, w_h, norm_h.eps),
            ],
            axis=-1,
        )
        return linear_kind(joined, fc_arrays, fc_kind)

    compiled_into = mx.compile(into)

    def step_in(tokens: mx.array, hidden: mx.array) -> mx.array:
        if isinstance(fc, QuantWeight):  # the norms, the concatenation and fc in one node
            return fused_layer.head_into(
                trunk.embed(tokens), hidden, norm_e.weight, norm_e.eps, norm_h.weight,
                norm_h.eps, fc,
            )  # fmt: skip
        return compiled_into(tokens, hidden, norm_e.weight, norm_h.weight, weight_arrays(fc))

    return (step_in, *_compiled_out(module))


def _compiled_out(
    module: NextNModule,
) -> tuple[
    Callable[[mx.array], tuple[mx.array | None, mx.array]],
    Callable[[mx.array, mx.array], tuple[mx.array | None, mx.array]],
]:
    """``_compiled_ends``' end: x [1, N, H] -> (logits or None for the trunk's head,
    norm(x)), the logits of every row or (``out_at``) of the rows asked for only; a
    quantized own LM head's in one kernel node (``fused_layer.head_out``) for the rows
    asked for or a single row, compiled otherwise. The LM head's product is
    batch-invariant, so projecting those rows alone gives each the bits it has in the
    projection of all of them."""
    norm = module.norm
    head = weight_of(module.lm_head) if "lm_head" in module else None
    head_kind = None if head is None else weight_kind(head)

    def out(x: mx.array, w: mx.array, head_arrays: Any) -> tuple[mx.array, mx.array]:
        normed = mx.fast.rms_norm(x, w, norm.eps)
        return linear_kind(normed, head_arrays, head_kind), normed

    def out_at(
        x: mx.array, rows: mx.array, w: mx.array, head_arrays: Any
    ) -> tuple[mx.array, mx.array]:
        normed = mx.fast.rms_norm(x, w, norm.eps)
        return linear_kind(positions(normed, rows), head_arrays, head_kind), normed

    compiled_out = mx.compile(out)
    compiled_out_at = mx.compile(out_at)
    compiled_norm = mx.compile(lambda x, w: mx.fast.rms_norm(x, w, norm.eps))

    def step_out(x: mx.array) -> tuple[mx.array | None, mx.array]:
        if head is None:
            return None, compiled_norm(x, norm.weight)
        if isinstance(head, QuantWeight) and x.shape[1] == 1:  # a deeper draft's one row
            return fused_layer.head_out(x, _zeros(1), norm.weight, norm.eps, head)
        logits, normed = compiled_out(x, norm.weight, weight_arrays(head))
        return logits, normed

    def step_out_at(x: mx.array, rows: mx.array) -> tuple[mx.array | None, mx.array]:
        if head is None:
            return None, compiled_norm(x, norm.weight)
        if isinstance(head, QuantWeight):  # the norm, the rows' slice and the product: one node
            return fused_layer.head_out(x, rows, norm.weight, norm.eps, head)
        logits, normed = compiled_out_at(x, rows, norm.weight, weight_arrays(head))
        return logits, normed

    return step_out, step_out_at


def _attend_row(
    attn: Any, cache: Any, q: mx.array, k: mx.array, v: mx.array, counts: mx.array
) -> mx.array:
    """One row's attention over its own cache on the fused attention kernel: q [T, heads, d]
    and k, v [T, kv_heads, d] (roped) of its tokens at positions ``counts - 1`` ([T] int32)
    -> [T, heads * d]. The keys and values go into the cache's buffers ([1, kv_heads,
    capacity, d], a ``LazyKVCache``'s or mlx-lm's ``KVCache``'s) at its offset; the kernel
    reads the buffer as a store of one slot, token t seeing its first ``counts[t]`` entries
    (the causal mask and the row's length in one count, lazy where the offset is)."""
    size = int(q.shape[0])
    if isinstance(cache, LazyKVCache):
        _write_lazy(cache, k, v)
    else:
        cache.update_and_fetch(k[None].transpose(0, 2, 1, 3), v[None].transpose(0, 2, 1, 3))
    return attention.attend(
        q, cache.keys, cache.values, _zeros(size), counts, attn.scale
    )  # [T, heads * d]


def _write_lazy(cache: LazyKVCache, k: mx.array, v: mx.array) -> None:
    """k, v [T, kv_heads, d] into a lazy cache's buffers at its (lazy) offset with the KV
    write kernel (``fused_layer.write``, one node each, in place where MLX allows): the
    entries ``update_and_fetch`` writes, without its transposes and slice updates."""
    size, kv_heads, dim = (int(n) for n in k.shape)
    like = mx.zeros((1, kv_heads, 1, dim), k.dtype)  # only its shape and dtype are read
    capacity = cache.reserve(size, like, like)
    assert cache.keys is not None and cache.values is not None
    write_at = _offset_add()(cache.offset, _store_rows(kv_heads, capacity, size))  # [kv * T]
    cache.keys, cache.values = fused_layer.write(
        cache.keys, cache.values, k, v, write_at, _arange(size), size
    )
    cache.advance(size)


@functools.lru_cache(maxsize=64)
def _store_rows(kv_heads: int, capacity: int, size: int) -> mx.array:
    """[kv_heads * T] int32, evaluated: head h's token t's row of a one-slot store at offset
    0 (``h * capacity + t``, the KV write's layout; the offset is added to it)."""
    rows = (
        mx.arange(kv_heads, dtype=mx.int32)[:, None] * capacity
        + mx.arange(size, dtype=mx.int32)[None]
    ).reshape(-1)
    mx.eval(rows)
    return rows


@functools.lru_cache(maxsize=64)
def _arange(size: int, start: int = 0) -> mx.array:
    """[size] int32 start .. start + size - 1, evaluated (a graph constant)."""
    rows = mx.arange(start, start + size, dtype=mx.int32)
    mx.eval(rows)
    return rows


@functools.cache
def _offset_add() -> Callable[[mx.array, mx.array], mx.array]:
    """A lazy [] int32 offset + an int32 constant [n], compiled: one graph node where the
    broadcast and the add are two (integer adds: the same values)."""
    return mx.compile(lambda offset, rows: offset + rows)


@functools.lru_cache(maxsize=8)
def _like(kv_heads: int, dim: int) -> mx.array:
    """[1, kv_heads, 1, dim] float32, evaluated: the shape and dtype of a token's keys, as a
    cache's ``reserve`` reads them (built once, where a fresh one costs every step's
    graph building)."""
    like = mx.zeros((1, kv_heads, 1, dim), mx.float32)
    mx.eval(like)
    return like


@functools.lru_cache(maxsize=64)
def _zeros(size: int) -> mx.array:
    """[size] int32 zeros, evaluated: every token's slot in a one-slot store (a constant of
    the graph, where ``mx.zeros`` would add nodes to every head step)."""
    zeros = mx.zeros((size,), mx.int32)
    mx.eval(zeros)
    return zeros


class RopeAngles:
    """The head's RoPE angles (cos, sin) by position, taken from tables of every position
    up to a bound (two gathers a step where computing them is ~12 graph nodes). The tables
    are the trunk's ``rope_tables`` over all their positions at once, evaluated when they
    grow; an angle depends on its position only, so a row's angles are the same whatever
    else is fed with it (the tables hold the bits ``rope_tables`` gives each position
    alone: ``tests/test_models_fused_head.py``)."""

    GROWTH = 1024  # positions the tables grow by

    def __init__(self, tables: Callable[[mx.array], tuple[mx.array, mx.array]]) -> None:
        self.tables = tables
        self.cos: mx.array | None = None  # [size, dims / 2]
        self.sin: mx.array | None = None
        self.size = 0

    def at(self, positions: mx.array, bound: int) -> tuple[mx.array, mx.array]:
        """cos and sin [N, dims / 2] of positions [N] int32 (lazy), every one below
        ``bound`` (what the host knows of them)."""
        cos, sin = self._tables(bound)
        return mx.take(cos, positions, axis=0), mx.take(sin, positions, axis=0)

    def run(self, start: mx.array, size: int, bound: int) -> tuple[mx.array, mx.array]:
        """``at`` of the positions start .. start + size - 1 (start [] int32, lazy): a
        dynamic slice of each table (one graph node, where a gather is two)."""
        cos, sin = self._tables(bound)
        half = int(cos.shape[1])
        return (
            mx.slice(cos, start, axes=(0,), slice_size=(size, half)),
            mx.slice(sin, start, axes=(0,), slice_size=(size, half)),
        )

    def _tables(self, bound: int) -> tuple[mx.array, mx.array]:
        """The tables (cos, sin [size, dims / 2]), grown first to hold every position below
        ``bound``."""
        if bound > self.size:
            size = -(-bound // self.GROWTH) * self.GROWTH
            cos, sin = self.tables(mx.arange(size, dtype=mx.int32))
            self.cos, self.sin = cos.reshape(size, -1), sin.reshape(size, -1)
            mx.eval(self.cos, self.sin)
            self.size = size
        assert self.cos is not None and self.sin is not None
        return self.cos, self.sin


def _bound(cache: Any) -> int:
    """What the host knows of a cache's offset: it is at most this (a ``LazyKVCache``'s
    ``bound``; mlx-lm's caches hold an int offset)."""
    return int(cache.bound) if isinstance(cache, LazyKVCache) else int(cache.offset)


def _positions(cache: Any, size: int) -> mx.array:
    """[size] int32: the positions of a row's next ``size`` entries (the cache's offset is
    an int, or a lazy [] int32 in a ``LazyKVCache``)."""
    return cache.offset + _arange(size)


def _fused_rows(
    parts: FusedHead,
    layer: Any,
    x: mx.array,
    sizes: list[int],
    caches: list[list[Any]],
) -> mx.array:
    """mlx-lm's llama layer over packed rows x [1, N, H] -> [1, N, H], its halves on the fused
    kernels: q / k / v of every token in one ``before`` (each roped at its own row's
    position), each row's cache and attention alone (``_attend_row``), then one ``after``."""
    attn = layer.self_attn
    norm = layer.input_layernorm
    bound = max(_bound(cache[0]) + size for size, cache in zip(sizes, caches, strict=True))
    if len(sizes) == 1 and isinstance(caches[0][0], LazyKVCache):  # a drafting cycle's feed
        offset = caches[0][0].offset  # [] int32, lazy
        cos, sin = parts.angles.run(offset, sizes[0], bound)
        counts = [_offset_add()(offset, _arange(sizes[0], 1))]  # [T]
    else:
        at = [_positions(cache[0], size) for size, cache in zip(sizes, caches, strict=True)]
        cos, sin = parts.angles.at(mx.concatenate(at) if len(at) > 1 else at[0], bound)
        counts = [row + 1 for row in at]
    if parts.layer_node and all(isinstance(cache[0], LazyKVCache) for cache in caches):
        return _layer_node(parts, x, sizes, [cache[0] for cache in caches], cos, sin, counts)
    queries, keys, values = fused_layer.before(
        x,
        norm.weight,
        parts.qkv,
        cos,
        sin,
        attn.n_heads,
        attn.n_kv_heads,
        attn.head_dim,
        attn.rope.dims,
        norm.eps,
    )  # [N, heads, d], [N, kv_heads, d] x 2
    outputs = []
    start = 0
    for size, cache, count in zip(sizes, caches, counts, strict=True):
        end = start + size
        q, k, v = queries, keys, values
        if len(sizes) > 1:
            q, k, v = q[start:end], k[start:end], v[start:end]
        outputs.append(_attend_row(attn, cache[0], q, k, v, count))
        start = end
    post = layer.post_attention_layernorm
    return fused_layer.after(
        x,
        mx.concatenate(outputs) if len(outputs) > 1 else outputs[0],
        parts.o_proj,
        post.weight,
        parts.gate_up,
        parts.down,
        post.eps,
    )


def _layer_node(
    parts: FusedHead,
    x: mx.array,
    sizes: list[int],
    caches: list[LazyKVCache],
    cos: mx.array,
    sin: mx.array,
    counts: list[mx.array],
) -> mx.array:
    """``_fused_rows`` over lazy caches in one node (``fused_layer.layer``): each row a group
    writing its own cache's buffers (a store of one slot, at the cache's lazy offset, as
    ``_write_lazy``) and attending over them (as ``_attend_row``), the five nodes' C functions
    in their order, so their bits. The buffers are written in place where nothing else holds
    them, as the KV write's."""
    w = parts.weights.weights
    stores = []
    groups = []
    start = 0
    for index, (size, cache, count) in enumerate(zip(sizes, caches, counts, strict=True)):
        like = _like(w.kv_heads, w.head_dim)
        capacity = cache.reserve(size, like, like)
        assert cache.keys is not None and cache.values is not None
        stores.append((cache.keys, cache.values))
        write_at = _offset_add()(cache.offset, _store_rows(w.kv_heads, capacity, size))
        groups.append(
            fused_layer.GroupWrite(
                index,
                start,
                start + size,
                write_at,
                _arange(size, start),  # the row's tokens among every row's packed ones
                size,
                _zeros(size),
                count,
            )
        )
        start += size
    out, written = fused_layer.layer(x, parts.weights, cos, sin, stores, groups)
    for size, cache, (keys, values) in zip(sizes, caches, written, strict=True):
        cache.keys, cache.values = keys, values
        cache.advance(size)
    return out
