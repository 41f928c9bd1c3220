"""Putting checkpoint tensors into head modules: every tensor consumed, every parameter
filled, shapes checked, quantized layers rebuilt from their scales, dtypes settled."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mtplx.models.checkpoint import CheckpointError


class MTPWeightError(CheckpointError):
    """An MTP weight is missing, unexpected or of the wrong shape; the message names it."""


_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.(weight|scales|biases)$")


def stack_experts(
    weights: dict[str, mx.array], names: dict[str, str]
) -> tuple[dict[str, mx.array], dict[str, str]]:
    """``*.experts.{e}.{proj}.{kind}`` -> ``*.switch_mlp.{proj}.{kind}`` stacked over e (the
    layout of mlx-lm's SwitchGLU). ``names`` maps each local name to its checkpoint key."""
    groups: dict[tuple[str, str, str], dict[int, str]] = {}
    out: dict[str, mx.array] = {}
    out_names: dict[str, str] = {}
    for name, value in weights.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name], out_names[name] = value, names[name]
            continue
        prefix, index, proj, kind = match.groups()
        groups.setdefault((prefix, proj, kind), {})[int(index)] = name
    for (prefix, proj, kind), members in groups.items():
        count = max(members) + 1
        missing = [e for e in range(count) if e not in members]
        if missing:
            key = names[members[max(members)]].replace(
                f"experts.{count - 1}.", f"experts.{missing[0]}."
            )
            raise MTPWeightError(f"missing MTP weight {key!r}")
        stacked = f"{prefix}.switch_mlp.{proj}.{kind}"
        out[stacked] = mx.stack([weights[members[e]] for e in range(count)])
        out_names[stacked] = names[members[0]].replace(".experts.0.", ".experts.*.")
    return out, out_names


def quantize_like(module: nn.Module, weights: dict[str, mx.array]) -> None:
    """Turn the layers of ``module`` whose weights come with ``.scales`` into quantized
    layers of the bits / group size the tensors were packed with."""
    if not any(name.endswith(".scales") for name in weights):
        return
    from mlx_lm.utils import infer_quant_config

    def predicate(path: str, layer: nn.Module) -> bool | dict:
        if not hasattr(layer, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, layer, weights)

    nn.quantize(module, class_predicate=predicate)


def load_checked(
    module: nn.Module,
    weights: dict[str, mx.array],
    key_of: Callable[[str], str],
    where: Callable[[str], str],
) -> None:
    """Load ``weights`` (module-local names) into ``module``; raise MTPWeightError naming the
    checkpoint key (``key_of(local)``) and its file (``where(key)``) of the first missing,
    unexpected or mis-shaped tensor."""
    quantize_like(module, weights)
    expected = dict(tree_flatten(module.parameters()))
    for name in sorted(weights):
        if name not in expected:
            key = key_of(name)
            raise MTPWeightError(f"unexpected MTP weight {key!r} in {where(key)}")
    for name in sorted(expected):
        if name not in weights:
            key = key_of(name)
            raise MTPWeightError(f"missing MTP weight {key!r} (not found in {where(key)})")
        if tuple(weights[name].shape) != tuple(expected[name].shape):
            key = key_of(name)
            raise MTPWeightError(
                f"MTP weight {key!r} in {where(key)} has shape {tuple(weights[name].shape)}, "
                f"expected {tuple(expected[name].shape)}"
            )
    module.load_weights(list(weights.items()), strict=True)


def settle_dtypes(module: nn.Module, *, dequantize: bool, to_float32: bool) -> None:
    """Dequantize quantized layers (``dequantize``) and cast bf16/f16 parameters to float32
    (``to_float32``: the CPU backend runs them 2-3x slower than float32)."""
    if dequantize:
        from mlx_lm.utils import dequantize_model

        dequantize_model(module)
    if to_float32:
        casts = [
            (name, value.astype(mx.float32))
            for name, value in _parameters(module)
            if value.dtype in (mx.bfloat16, mx.float16)
        ]
        if casts:
            module.update(tree_unflatten(casts))
    mx.eval(module.parameters())


def _parameters(module: nn.Module) -> list[tuple[str, mx.array]]:
    """(dotted name, array) of every parameter (``tree_flatten`` without a destination
    returns this list; its stub also allows the dict form it fills when given one)."""
    return cast(list[tuple[str, mx.array]], tree_flatten(module.parameters()))
