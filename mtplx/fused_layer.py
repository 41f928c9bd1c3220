"""A llama decoder layer in a few fused CPU kernels (``layer_kernel.c``): same bits, fewer nodes.

On MLX's CPU backend every graph node costs a dispatch and an allocation (~5 us here)
whatever it computes, and a compiled llama layer is still ~60 of them: products, norms,
RoPE, activation, residuals, and the slices, reshapes and scatters around them. Here a layer
of a quantized trunk is five nodes (one group of rows):

- ``before``: input RMSNorm, the fused q/k/v product, RoPE -> q, k, v;
- ``write``: the new keys, and the new values, into the layer's KV store (a node each; in
  place when MLX can hand the store's buffer over, as its own scatter does);
- the fused attention kernel (``mtplx.attention``) over the store;
- ``after``: o_proj, residual, post-attention RMSNorm, fused gate/up, SwiGLU, down, residual.

``layer`` runs all five in one node (the same C functions in the same order, so the same
bits): a step of the trunk is then one node a layer instead of five, and every node saves
the engine thread building it and MLX's eval thread dispatching it.

The products are the batch-invariant quantized kernel's (``mtplx.quant``), called from C, in
the ``--activations`` mode every quantized product of the process takes;
every elementwise step is MLX's own CPU operation in MLX's order (RMSNorm's sequential sum,
MLX's scalar exp inside the sigmoid, RoPE's products rounded one by one), so the fused path
gives the compiled path's bits exactly and the two can serve side by side
(``tests/test_fused_layer.py`` compares them bitwise, and the pieces against NumPy).

It serves quantized trunks on the CPU whose RoPE the compiled path hoists (mlx's plain
RoPE); float32 trunks and Metal keep ``mtplx.models.compiled_layer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import mlx.core as mx

from mtplx.models.quantized import QuantWeight, activations_format
from mtplx.quant import Unavailable, load_extension

__all__ = [
    "after",
    "available",
    "before",
    "exp",
    "greedy_draft",
    "greedy_verdict",
    "group_args",
    "head_into",
    "head_out",
    "layer",
    "prepare",
    "rms_norm",
    "store_copies",
    "swiglu",
    "verdict_counts",
    "write",
]


def _int8_rows(int8: bool | None) -> bool:
    """Whether the kernels quantize their rows to 8 bits: ``int8``, or the process's
    ``activations_format`` where it is None (read when the graph is built)."""
    return activations_format() == "int8" if int8 is None else int8


def available() -> bool:
    """Whether the fused kernels serve here (CPU, extension built)."""
    if mx.default_device() != mx.cpu:
        return False
    try:
        load_extension()
    except Unavailable:
        return False
    return True


def before(
    x: mx.array,
    norm: mx.array,
    qkv: QuantWeight,
    cos: mx.array,
    sin: mx.array,
    heads: int,
    kv_heads: int,
    head_dim: int,
    rope_dims: int,
    eps: float,
    int8: bool | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """A layer's first half, lazily: x [..., N, H], norm [H], cos and sin [N or 1, dims / 2]
    (mlx's RoPE angles of each token, or of the one token) -> q [N, heads, d] and k, v
    [N, kv_heads, d] (q and k roped). ``int8``: the activations mode (None: the process's,
    ``activations_format()``; a forward reads it once for all its layers)."""
    q, k, v = load_extension().layer_before(
        x,
        norm,
        *qkv.arrays,
        qkv.bits,
        qkv.group_size,
        cos,
        sin,
        heads,
        kv_heads,
        head_dim,
        rope_dims,
        float(eps),
        _int8_rows(int8),
    )
    return q, k, v


def after(
    x: mx.array,
    attended: mx.array,
    o_proj: QuantWeight,
    norm: mx.array,
    gate_up: QuantWeight,
    down: QuantWeight,
    eps: float,
    int8: bool | None = None,
) -> mx.array:
    """A layer's second half, lazily: x [..., N, H], attended [N, heads * d] -> [..., N, H]:
    ``x + o``, then ``+ down(swiglu(gate_up(rms_norm(x + o))))``; ``int8`` as ``before``."""
    return load_extension().layer_after(
        x,
        attended,
        norm,
        *o_proj.arrays,
        o_proj.bits,
        o_proj.group_size,
        *gate_up.arrays,
        gate_up.bits,
        gate_up.group_size,
        *down.arrays,
        down.bits,
        down.group_size,
        float(eps),
        _int8_rows(int8),
    )


def write(
    keys: mx.array,
    values: mx.array,
    k: mx.array,
    v: mx.array,
    write_at: mx.array,
    to_padded: mx.array,
    tokens: int,
) -> tuple[mx.array, mx.array]:
    """A group's new keys and values written into a layer's store, lazily: keys [S, kv, cap,
    d], values [S, kv, cap, d + 1], k and v [N, kv, d] (every packed token), write_at [R * kv
    * T] (each padded (row, head, token)'s flat store row), to_padded [R * T] (the packed
    token each padded position takes), tokens = T -> the stores after the write, values with
    their constant 1 feature (what ``mtplx.models.slot_attention.write_group`` writes)."""
    ext = load_extension()
    new_keys = ext.kv_write(keys, k, write_at, to_padded, int(tokens))
    return new_keys, ext.kv_write(values, v, write_at, to_padded, int(tokens))


class LayerWeights(NamedTuple):
    """A layer's weights and shapes as ``layer`` takes them (gathered once per layer)."""

    input_norm: mx.array  # [H]
    qkv: QuantWeight
    heads: int
    kv_heads: int
    head_dim: int
    rope_dims: int
    input_eps: float
    scale: float
    o_proj: QuantWeight
    post_norm: mx.array  # [H]
    gate_up: QuantWeight
    down: QuantWeight
    post_eps: float


class GroupWrite(NamedTuple):
    """One group of a forward as ``layer`` takes it: ``store``, its index into the stores;
    the group's packed tokens [start, end); ``write_at``, ``to_padded`` and ``tokens`` as
    ``write`` takes them; ``slots`` and ``counts`` as ``mtplx.attention.attend``."""

    store: int
    start: int
    end: int
    write_at: mx.array
    to_padded: mx.array
    tokens: int
    slots: mx.array
    counts: mx.array


class PreparedLayer(NamedTuple):
    """A layer's weights with ``layer``'s arguments built from them once (``prepare``): a
    trunk step calls ``layer`` once a layer, and unpacking the weights every call is a few
    microseconds of the engine thread each."""

    weights: LayerWeights
    before: tuple[object, ...]  # the kernel call's arguments between x and cos
    after: tuple[object, ...]  # those between sin and the activations mode


def prepare(weights: LayerWeights) -> PreparedLayer:
    """``weights`` with ``layer``'s arguments built (see ``PreparedLayer``)."""
    w = weights
    before = (w.input_norm, *w.qkv.arrays, w.qkv.bits, w.qkv.group_size)
    after = (
        w.heads,
        w.kv_heads,
        w.head_dim,
        w.rope_dims,
        float(w.input_eps),
        float(w.scale),
        *w.o_proj.arrays,
        w.o_proj.bits,
        w.o_proj.group_size,
        w.post_norm,
        *w.gate_up.arrays,
        w.gate_up.bits,
        w.gate_up.group_size,
        *w.down.arrays,
        w.down.bits,
        w.down.group_size,
        float(w.post_eps),
    )
    return PreparedLayer(w, before, after)


class GroupArgs(NamedTuple):
    """A forward's groups as ``layer`` hands them to the kernel (``group_args``): the same
    for every layer of the forward, so built once for all of them."""

    arrays: list[mx.array]  # each group's write_at, to_padded, slots, counts
    meta: list[int]  # each group's store, start, end, tokens


def group_args(groups: Sequence[GroupWrite]) -> GroupArgs:
    """``groups`` as ``layer`` hands them to the kernel (see ``GroupArgs``)."""
    arrays: list[mx.array] = []
    meta: list[int] = []
    for group in groups:
        arrays += [group.write_at, group.to_padded, group.slots, group.counts]
        meta += [group.store, group.start, group.end, int(group.tokens)]
    return GroupArgs(arrays, meta)


def layer(
    x: mx.array,
    weights: LayerWeights | PreparedLayer,
    cos: mx.array,
    sin: mx.array,
    stores: Sequence[tuple[mx.array, mx.array]],
    groups: Sequence[GroupWrite] | GroupArgs,
    int8: bool | None = None,
) -> tuple[mx.array, list[tuple[mx.array, mx.array]]]:
    """A whole layer, lazily, in one node: ``before``, then per group in order its keys and
    values written (``write``) and its attention over its store (``mtplx.attention``), the
    groups' results concatenated, then ``after`` -- the same C functions in the same order,
    so the five nodes' bits. x [..., N, H] (the groups' segments cover the N tokens in
    order), stores: (keys, values) of each distinct store the groups write -> (the layer's
    output [..., N, H], each store after the writes). A store is written in place where
    nothing else holds it, as ``write``'s. ``weights`` and ``groups`` may come prepared
    (``prepare``, ``group_args``), as a forward over many layers passes them."""
    prepared = weights if isinstance(weights, PreparedLayer) else prepare(weights)
    args = groups if isinstance(groups, GroupArgs) else group_args(groups)
    out = load_extension().layer_step(
        x,
        *prepared.before,
        cos,
        sin,
        *prepared.after,
        _int8_rows(int8),
        [a for pair in stores for a in pair],
        args.arrays,
        args.meta,
    )
    return out[0], [(out[1 + 2 * s], out[2 + 2 * s]) for s in range(len(stores))]


def head_into(
    embedded: mx.array,
    hidden: mx.array,
    norm_e: mx.array,
    eps_e: float,
    norm_h: mx.array,
    eps_h: float,
    fc: QuantWeight,
    int8: bool | None = None,
) -> mx.array:
    """A generic MTP head's input, lazily, in one node: embedded, hidden [..., N, H] ->
    ``fc(concat(rms_norm(embedded) * norm_e, rms_norm(hidden) * norm_h))`` [..., N, H'],
    the norms and the product as ``before``'s (MLX's bits); ``int8`` as ``before``."""
    return load_extension().head_into(
        embedded,
        hidden,
        norm_e,
        float(eps_e),
        norm_h,
        float(eps_h),
        *fc.arrays,
        fc.bits,
        fc.group_size,
        _int8_rows(int8),
    )


def head_out(
    x: mx.array,
    at: mx.array,
    norm: mx.array,
    eps: float,
    head: QuantWeight,
    int8: bool | None = None,
) -> tuple[mx.array, mx.array]:
    """A generic MTP head's output, lazily, in one node: x [1, N, H], at [R] or [] int32
    (rows of x, lazy) -> (logits [1, R or 1, V] of ``rms_norm(x) * norm`` at those rows
    only, ``rms_norm(x) * norm`` [1, N, H]); ``int8`` as ``before``. The product is
    batch-invariant: a row's logits are the bits it has among all rows."""
    logits, normed = load_extension().head_out(
        x,
        at,
        norm,
        float(eps),
        *head.arrays,
        head.bits,
        head.group_size,
        _int8_rows(int8),
    )
    return logits, normed


def greedy_draft(logits: mx.array, vocab: mx.array) -> mx.array:
    """A greedy draft token over a reduced draft vocabulary, lazily, in one node: logits of
    V' values and vocab [V'] (each entry's target id) -> [] int32 ``vocab[argmax(logits)]``,
    MLX's argmax (the first maximum, a NaN above all): the bits of ``mx.argmax``, a take and
    a cast, where those are 4 nodes."""
    token: mx.array = load_extension().greedy_draft(logits, vocab)
    return token


def greedy_verdict(logits: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """``mlx_ops.mx_verify_greedy``'s verdict, lazily, in one node: logits [B, k+1, V] and
    drafts [B, k], or one row's [k+1, V] and [k] (B = 1, no reshape node) -> (num_accepted
    [B] int32, output_tokens [B, k+1] int32). The argmax is MLX's (the first maximum, a NaN
    above all), so the ints are bitwise ``mx_verify_greedy``'s; where that is 9
    nodes (argmax, matches, count, the -1 mask and the reshapes around them), each a
    dispatch and ~15 us of the engine thread, this is one."""
    accepted, tokens = load_extension().greedy_verdict(logits, drafts)
    return accepted, tokens


def verdict_counts(
    num_accepted: mx.array, output_tokens: mx.array
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """What a queued drafting cycle takes from one row's verdict (num_accepted [1],
    output_tokens [1, k+1] int32), lazily, in one node: (num_rejected [] = k - accepted,
    num_valid [] = accepted + 1, the tokens [k+1], the last committed token [1] =
    tokens[accepted]), the ints MLX's reshape, subtraction, addition and take give, where
    those are 7 nodes."""
    rejected, valid, tokens, last = load_extension().verdict_counts(num_accepted, output_tokens)
    return rejected, valid, tokens, last


def store_copies() -> int:
    """KV stores a write (``write``, ``layer``) copied instead of writing in place so far:
    each copy costs the whole store's bytes, so a steady decode loop should add none."""
    return int(load_extension().store_copies())


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """The kernel's RMSNorm on x [..., H] alone, evaluated (for tests)."""
    return load_extension().rms_norm_reference(x, weight, float(eps))


def swiglu(gate_up: mx.array) -> mx.array:
    """The kernel's SwiGLU on [..., 2 I] ([gate | up]) alone, evaluated (for tests)."""
    return load_extension().swiglu_reference(gate_up)


def exp(x: float) -> float:
    """The kernel's copy of MLX's CPU exp on one value (for tests)."""
    return float(load_extension().layer_exp(float(x)))
