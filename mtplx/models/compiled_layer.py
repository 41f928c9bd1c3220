"""A llama decoder layer's pieces for ``SlotTarget``, compiled with ``mx.compile``.

Building a forward's graph in Python costs ~10 ms on the default model (30 layers of ~40
MLX ops each). A plain step hides it behind the previous step's compute (the next forward
is queued before the current token is read); a drafting step cannot, since it must read its
verdict before it can build the next forward, so the build is most of what a drafting cycle
costs over a plain one on a CPU. Compiled, each layer is three calls instead of ~40 ops:

- ``project``: input norm, the fused q/k/v product, RoPE -> queries, keys, values;
- ``attend``: a group's scores, mask, softmax and ``@ [V | 1]`` over the KV store (MLX ops:
  where the fused attention kernel, ``mtplx.attention``, serves, ``SlotTarget`` calls it
  between ``project`` and ``finish`` instead);
- ``finish``: o_proj, residual, post-attention norm, fused gate/up, SwiGLU, down, residual.

Writing the new keys and values into the store stays outside (MLX updates the store in
place only when nothing else holds it; a compiled function would copy it every layer).

Exactness: the pieces are the uncompiled path's ops in the same order, and MLX's elementwise
fusion changes no bits (``tests/test_models_compiled_layer.py`` compares logits bitwise).
``attend`` runs over a group's span (its key length rounded up to ``ATTEND_STEP``), not its
exact key length: keys past a row's length get -inf scores and zero weights, trailing zeros
that the invariant kernel adds as +0.0 (``mtplx/blas_invariant.c``), so the bits are those of
the shorter product while the traced shapes change only every ``ATTEND_STEP`` positions. (Not
the store's whole capacity either: it never shrinks, so after one long request every short
one would pay for it.) A trace is kept per input shape (rows, tokens, span).

Cold start: MLX builds the fused CPU kernels with the system compiler on first use (~20 s
on the default model, cached by MLX under the temp directory; well under 1 s on the next
start). ``Engine.warm_up`` runs before the calibration times anything, and the calibration
steps every shape it times before timing it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu

from mtplx.models.quantized import (
    InvariantQuantizedLinear,
    linear_kind,
    weight_kind,
    weight_of,
)

logger = logging.getLogger(__name__)


def _same_rope(a: Any, b: Any) -> bool:
    """Whether two RoPE modules compute the same function (type, settings, tables)."""
    if type(a) is not type(b):
        return False
    settings_a, settings_b = vars(a), vars(b)
    if settings_a.keys() != settings_b.keys():
        return False
    for key, value in settings_a.items():
        other = settings_b[key]
        if isinstance(value, mx.array) or isinstance(other, mx.array):
            if not (
                isinstance(value, mx.array)
                and isinstance(other, mx.array)
                and value.shape == other.shape
                and mx.array_equal(value, other).item()
            ):
                return False
        elif value != other:
            return False
    return True


def _plain_linear(module: Any) -> bool:
    return type(module) in (nn.Linear, InvariantQuantizedLinear) and "bias" not in module


def _compile_works() -> bool:
    """Whether ``mx.compile`` can build and run a fused kernel here (it needs the system C++
    compiler on CPUs)."""
    try:
        probe = mx.compile(lambda a: mx.exp(a * 2.0) + 1.0)
        mx.eval(probe(mx.zeros((2,))))
        return True
    except Exception:  # no compiler, an unwritable kernel cache: the uncompiled path is exact
        logger.warning("mx.compile is unavailable; forwards build every op", exc_info=True)
        return False


class CompiledLayer:
    """The compiled pieces of one trunk's layers (they share shapes, so one trace serves all
    layers). Use ``for_trunk``: it returns None for layers these pieces do not describe."""

    def __init__(
        self,
        attention: Any,
        q_size: int,
        kv_size: int,
        intermediate: int,
        kinds: tuple[tuple[int, int] | None, ...] = (None, None, None, None),
    ) -> None:
        # kinds: (bits, group size) of the qkv, o, gate/up and down weights, None for float
        # ones; constants of the traces (the weights' arrays are their inputs).
        qkv_kind, o_kind, gate_up_kind, down_kind = kinds
        heads, kv_heads = attention.n_heads, attention.n_kv_heads
        repeats = heads // kv_heads
        k_end = q_size + kv_size
        rope = attention.rope
        # mlx's plain RoPE: its angles are computed once per forward (rope_tables) instead
        # of in every layer (8 graph nodes a layer), then applied as mx.fast.rope's CPU
        # implementation applies them. Other RoPE variants run as they are in each layer.
        plain_rope = type(rope) is nn.RoPE and not rope.traditional
        self.hoists_rope = plain_rope

        def rope_tables(positions: mx.array) -> tuple[mx.array, mx.array]:
            # positions [N] int32 -> cos and sin of the angles, [N, 1, 1, dims / 2] ([1,
            # dims / 2] for one token): mx.fast.rope's CPU fallback op for op, in float32
            # (its log(base) / (dims / 2) is a float32 expression: computed as one here).
            half = rope.dims // 2
            offset = positions[:, None, None] if positions.size > 1 else positions
            at = (mx.arange(1, dtype=mx.float32) + offset) * mx.array(rope.scale, mx.float32)
            step = np.float32(np.log(np.float32(rope.base))) / np.float32(half)
            inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(step))
            theta = at[..., None] * inv_freqs
            return mx.cos(theta), mx.sin(theta)

        def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
            # x [N, heads, 1, d]: the rotation of mx.fast.rope's fallback (non-traditional)
            half = rope.dims // 2
            x1, x2 = x[..., :half], x[..., half : rope.dims]
            outs = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
            if rope.dims < x.shape[-1]:
                outs.append(x[..., rope.dims :])
            return mx.concatenate(outs, axis=-1)

        def project(
            x: mx.array,
            norm: mx.array,
            qkv_weight: Any,
            positions: mx.array | tuple[mx.array, mx.array],
            eps: float,
        ) -> tuple[mx.array, mx.array, mx.array]:
            # x [1, N, H] -> queries [N, heads, 1, d], keys and values [N, kv, 1, d];
            # positions: [N] int32, or rope_tables' (cos, sin) where the RoPE is hoisted
            qkv = linear_kind(mx.fast.rms_norm(x, norm, eps), qkv_weight, qkv_kind).squeeze(0)
            n = qkv.shape[0]
            rotated = qkv[:, :k_end].reshape(n, heads + kv_heads, 1, -1)
            if isinstance(positions, tuple):
                roped = apply_rope(rotated, *positions)
            else:
                roped = rope(rotated, offset=positions)
            return roped[:, :heads], roped[:, heads:], qkv[:, k_end:].reshape(n, kv_heads, 1, -1)

        def attend(
            queries: mx.array,
            keys: mx.array,
            values: mx.array,
            visible: mx.array,
            scale: float,
        ) -> mx.array:
            # queries [R, heads, T, d], keys [R, kv, d, S], values [R, kv, S, d+1],
            # visible [R, 1, 1, T, S] -> [R * T, heads * d]
            rows, _, tokens, head_dim = queries.shape
            span = keys.shape[-1]
            grouped = (queries * scale).reshape(rows, kv_heads, repeats * tokens, head_dim)
            scores = (grouped @ keys).reshape(rows, kv_heads, repeats, tokens, span)
            scores = mx.where(visible, scores, -mx.inf)
            weights = mx.exp(scores - mx.max(scores, axis=-1, keepdims=True))
            summed = weights.reshape(rows, kv_heads, repeats * tokens, span) @ values
            attended = summed[..., :head_dim] / summed[..., head_dim:]
            attended = attended.reshape(rows, heads, tokens, head_dim).transpose(0, 2, 1, 3)
            return attended.reshape(rows * tokens, heads * head_dim)

        def finish(
            x: mx.array,
            attended: mx.array,
            o_weight: Any,
            norm: mx.array,
            gate_up_weight: Any,
            down_weight: Any,
            eps: float,
        ) -> mx.array:
            # x [1, N, H], attended [N, heads * d] -> [1, N, H]
            x = x + linear_kind(attended[None], o_weight, o_kind)
            gate_up = linear_kind(mx.fast.rms_norm(x, norm, eps), gate_up_weight, gate_up_kind)
            gated = swiglu(gate_up[..., :intermediate], gate_up[..., intermediate:])
            return x + linear_kind(gated, down_weight, down_kind)

        self.project: Callable[..., tuple[mx.array, mx.array, mx.array]] = mx.compile(project)
        self.rope_tables: Callable[[mx.array], tuple[mx.array, mx.array]] = mx.compile(rope_tables)
        self.attend: Callable[..., mx.array] = mx.compile(attend)
        self.finish: Callable[..., mx.array] = mx.compile(finish)

    @classmethod
    def for_trunk(cls, layers: list[Any], fused: list[Any]) -> CompiledLayer | None:
        """The compiled pieces for ``layers`` (with their fused projections), or None unless
        every layer is mlx-lm's llama layer as the pieces spell it: fused q/k/v and gate/up
        without biases, RMS norms, bias-free o_proj and down_proj, one RoPE."""
        if not layers or any(f is None for f in fused):
            return None
        first = layers[0].self_attn

        def kinds_of(layer: Any, projections: Any) -> tuple[tuple[int, int] | None, ...]:
            return (
                weight_kind(projections.qkv),
                weight_kind(weight_of(layer.self_attn.o_proj)),
                weight_kind(projections.gate_up),
                weight_kind(weight_of(layer.mlp.down_proj)),
            )

        kinds = kinds_of(layers[0], fused[0])
        for layer, projections in zip(layers, fused, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            if (
                projections.qkv_bias is not None
                or projections.gate_up_bias is not None
                or type(layer.input_layernorm) is not nn.RMSNorm
                or type(layer.post_attention_layernorm) is not nn.RMSNorm
                or not _plain_linear(attn.o_proj)
                or not _plain_linear(mlp.down_proj)
                or kinds_of(layer, projections) != kinds
                or (attn.n_heads, attn.n_kv_heads) != (first.n_heads, first.n_kv_heads)
                or not _same_rope(attn.rope, first.rope)
                or projections.q_size != fused[0].q_size
                or projections.kv_size != fused[0].kv_size
                or projections.intermediate != fused[0].intermediate
            ):
                return None
        if not _compile_works():
            return None
        return cls(first, fused[0].q_size, fused[0].kv_size, fused[0].intermediate, kinds)
