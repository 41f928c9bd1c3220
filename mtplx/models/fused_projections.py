"""One weight for a layer's projections that read the same input: q, k and v as ``[q | k | v]``
rows, the MLP's gate and up as ``[gate | up]``, so that ``SlotTarget`` runs one product
instead of three (two) per layer. The layer's own modules keep working, on views of the
fused weights, so the weights are held once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtplx.models.quantized import InvariantQuantizedLinear, QuantWeight, linear

__all__ = ["FusedProjections", "fuse_projections", "fused_linear"]


@dataclass
class FusedProjections:
    """One layer's projections that read the same input, as one weight each: q, k and v
    ([q | k | v] rows), the MLP's gate and up ([gate | up] rows). One product instead of three
    (two) costs fewer MLX ops and kernel calls per layer, and gives the same bits: the
    invariant kernel sums every output element in a fixed order over the input alone,
    whatever the other columns of the product."""

    qkv: mx.array | QuantWeight  # [q_out + 2 kv_out, H]
    qkv_bias: mx.array | None
    q_size: int
    kv_size: int
    gate_up: mx.array | QuantWeight  # [2 I, H]
    gate_up_bias: mx.array | None
    intermediate: int


def fuse_projections(layer: Any) -> FusedProjections | None:
    """The layer's fused projections (their modules then read slices of them, so the
    weights are held once), or None when they are neither all plain float ``nn.Linear``
    layers nor all kernel-quantized ones of one format without biases."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj))
    if all(type(m) is InvariantQuantizedLinear for g in groups for m in g):
        return _fuse_quantized(attn, mlp, groups)
    if not all(type(m) is nn.Linear for g in groups for m in g):
        return None
    fused = []
    for modules in groups:
        has_bias = ["bias" in m for m in modules]
        if any(has_bias) and not all(has_bias):
            return None
        weight = mx.concatenate([m.weight for m in modules])
        bias = mx.concatenate([m.bias for m in modules]) if all(has_bias) else None
        mx.eval(weight, bias)
        start = 0
        for m in modules:  # the modules keep working, on views of the fused weight
            size = m.weight.shape[0]
            m.weight = weight[start : start + size]
            if bias is not None:
                m.bias = bias[start : start + size]
            start += size
        mx.eval([(m.weight, m.get("bias")) for m in modules])
        fused.append((weight, bias))
    (qkv, qkv_bias), (gate_up, gate_up_bias) = fused
    return FusedProjections(
        qkv=qkv,
        qkv_bias=qkv_bias,
        q_size=attn.q_proj.weight.shape[0],
        kv_size=attn.k_proj.weight.shape[0],
        gate_up=gate_up,
        gate_up_bias=gate_up_bias,
        intermediate=mlp.gate_proj.weight.shape[0],
    )


def _fuse_quantized(
    attn: Any, mlp: Any, groups: tuple[tuple[Any, ...], ...]
) -> FusedProjections | None:
    """``fuse_projections`` for kernel-quantized projections: output rows are quantized
    independently, so stacking the packed weights, scales and biases row-wise is exact."""
    fused: list[QuantWeight] = []
    for modules in groups:
        kinds = {m.quant.kind for m in modules}
        if len(kinds) != 1 or any("bias" in m for m in modules):
            return None
        bits, group_size = kinds.pop()
        arrays = [mx.concatenate([m.quant.arrays[i] for m in modules]) for i in range(3)]
        mx.eval(arrays)
        start = 0
        for m in modules:  # the modules keep working, on views of the fused arrays
            size = m.weight.shape[0]
            m.weight, m.scales, m.biases = (a[start : start + size] for a in arrays)
            start += size
        mx.eval([(m.weight, m.scales, m.biases) for m in modules])
        weight, scales, biases = arrays
        fused.append(QuantWeight(weight, scales, biases, bits, group_size))
    qkv, gate_up = fused
    return FusedProjections(
        qkv=qkv,
        qkv_bias=None,
        q_size=attn.q_proj.weight.shape[0],
        kv_size=attn.k_proj.weight.shape[0],
        gate_up=gate_up,
        gate_up_bias=None,
        intermediate=mlp.gate_proj.weight.shape[0],
    )


def fused_linear(x: mx.array, weight: mx.array | QuantWeight, bias: mx.array | None) -> mx.array:
    """What ``nn.Linear`` (or the kernel-quantized layer) computes, for a fused weight."""
    if isinstance(weight, QuantWeight):
        y = linear(x, weight)
        return y if bias is None else y + bias
    return x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)
