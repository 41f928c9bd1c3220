"""Quantized layers served as they are on the CPU, through the batch-invariant kernel.

mlx-lm builds ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding`` for a checkpoint with a
``quantization`` entry; their products call ``mx.quantized_matmul``, which on MLX's CPU
backend dequantizes the weight again for every row and sums in a shape-dependent order.
``serve_quantized`` swaps them for ``InvariantQuantizedLinear`` / ``InvariantQuantizedEmbedding``,
which hold the same arrays and call ``mtplx.quant.qmm`` instead: weights stay 4 or 8 bits in
memory and every product is bitwise independent of how many rows share it.

Which format the CPU serves is chosen by ``MTPLX_WEIGHTS`` (``--weights`` on the command
line): ``native`` (default) keeps the checkpoint's quantization where the kernel takes it;
``f32`` dequantizes everything to float32 (the format before the kernel existed, kept for
comparison and for models that need it). Layers the kernel does not take (other modes, bit
widths or group sizes) are dequantized one by one. How the kernel treats the rows it
multiplies is ``MTPLX_ACTIVATIONS`` (``--activations``, ``activations_format``): ``int8``
(default: 8-bit rows, integer dot products, llama.cpp's kind of arithmetic) or ``float32``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

logger = logging.getLogger(__name__)

__all__ = [
    "ACTIVATIONS",
    "DEFAULT_ACTIVATIONS",
    "FORMATS",
    "InvariantQuantizedEmbedding",
    "InvariantQuantizedLinear",
    "QuantWeight",
    "activation_dtype",
    "activations_format",
    "describe_weights",
    "linear",
    "linear_kind",
    "quantize_draft_head",
    "serve_quantized",
    "weight_arrays",
    "weight_kind",
    "weight_of",
    "weights_format",
]

FORMATS = ("native", "f32")
ACTIVATIONS = ("int8", "float32")
DEFAULT_ACTIVATIONS = "int8"
KERNEL_BITS = (4, 8)
KERNEL_GROUPS = (32, 64, 128)


def weights_format() -> str:
    """``native`` or ``f32``, from ``MTPLX_WEIGHTS`` (default ``native``)."""
    value = os.environ.get("MTPLX_WEIGHTS", "native").strip().lower() or "native"
    if value in ("float32", "fp32"):
        value = "f32"
    if value not in FORMATS:
        raise ValueError(f"MTPLX_WEIGHTS={value!r}: expected one of {', '.join(FORMATS)}")
    return value


def activations_format() -> str:
    """How quantized products treat their rows, from ``MTPLX_ACTIVATIONS`` (``--activations``):
    ``int8`` (default) quantizes them per weight group to 8 bits and uses integer dot
    products (as llama.cpp does: faster, different numbers, still batch-invariant);
    ``float32`` multiplies them by the dequantized weights (the float32 path's numbers, to
    its rounding). A process setting, read when
    a forward's graph is built: set it before loading a model."""
    raw = os.environ.get("MTPLX_ACTIVATIONS")
    known = _activations_of.get(raw)  # the graph builders read it per node: parse it once
    if known is not None:
        return known
    value = (raw or "").strip().lower() or DEFAULT_ACTIVATIONS
    if value in ("f32", "fp32"):
        value = "float32"
    if value not in ACTIVATIONS:
        raise ValueError(f"MTPLX_ACTIVATIONS={value!r}: expected one of {', '.join(ACTIVATIONS)}")
    _activations_of[raw] = value
    return value


_activations_of: dict[str | None, str] = {}  # MTPLX_ACTIVATIONS as set -> its mode


class QuantWeight(NamedTuple):
    """A weight in MLX's affine layout: ``w`` uint32 [N, K * bits / 32], ``scales`` and
    ``biases`` [N, K / group_size], float16 or float32."""

    w: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    @property
    def arrays(self) -> tuple[mx.array, mx.array, mx.array]:
        return self.w, self.scales, self.biases

    @property
    def shape(self) -> tuple[int, int]:
        """The dequantized weight's shape, [N, K]."""
        return int(self.w.shape[0]), int(self.w.shape[1]) * 32 // self.bits

    @property
    def kind(self) -> tuple[int, int]:
        return self.bits, self.group_size


def linear(x: mx.array, weight: mx.array | QuantWeight) -> mx.array:
    """``x @ weight.T`` for a float weight or a quantized one (the invariant kernel, in the
    ``activations_format()`` mode)."""
    if isinstance(weight, QuantWeight):
        from mtplx.quant import qmm

        return qmm(x, *weight.arrays, weight.bits, weight.group_size, activations_format())
    return x @ weight.T


def weight_of(module: Any) -> mx.array | QuantWeight:
    """The weight a linear layer's product uses: its float array, or its ``QuantWeight``."""
    if isinstance(module, InvariantQuantizedLinear):
        return module.quant
    return module.weight


def weight_kind(weight: mx.array | QuantWeight) -> tuple[int, int] | None:
    """(bits, group size) of a quantized weight, None for a float one."""
    return weight.kind if isinstance(weight, QuantWeight) else None


def weight_arrays(weight: mx.array | QuantWeight) -> mx.array | tuple[mx.array, ...]:
    """What a compiled function takes for a weight: the array, or (w, scales, biases); the
    bits and group size are constants of the compiled function (``weight_kind``)."""
    return weight.arrays if isinstance(weight, QuantWeight) else weight


def linear_kind(
    x: mx.array, arrays: mx.array | tuple[mx.array, ...], kind: tuple[int, int] | None
) -> mx.array:
    """``linear`` from ``weight_arrays`` and ``weight_kind`` (inside compiled functions)."""
    if kind is None:
        assert isinstance(arrays, mx.array)
        return x @ arrays.T
    w, scales, biases = arrays
    return linear(x, QuantWeight(w, scales, biases, *kind))


def activation_dtype(inner: Any) -> mx.Dtype:
    """The dtype of a trunk's hidden states: its embedding's, float32 for a quantized one."""
    embed = inner.embed_tokens
    if isinstance(embed, InvariantQuantizedEmbedding):
        return mx.float32
    if isinstance(embed, nn.QuantizedEmbedding):
        return embed.scales.dtype
    return embed.weight.dtype


def _kernel_params(scales: mx.array, biases: mx.array | None) -> tuple[mx.array, mx.array]:
    """Scales and biases as the kernel reads them: float16 where that is exact (GGUF's are
    float16 to begin with: half the bytes of float32 to read per token), else float32."""
    if biases is None:  # MLX's non-affine modes have none; ``_kernel_takes`` admits affine only
        raise ValueError("the quantized kernel takes affine weights (scales and biases)")
    s32, b32 = scales.astype(mx.float32), biases.astype(mx.float32)
    s16, b16 = s32.astype(mx.float16), b32.astype(mx.float16)
    exact = mx.array_equal(s16.astype(mx.float32), s32) and mx.array_equal(
        b16.astype(mx.float32), b32
    )
    return (s16, b16) if bool(exact.item()) else (s32, b32)


class InvariantQuantizedLinear(nn.Module):
    """``nn.QuantizedLinear``'s parameters, the product through ``mtplx.quant.qmm``."""

    def __init__(self, source: nn.QuantizedLinear) -> None:
        super().__init__()
        self.group_size, self.bits = int(source.group_size), int(source.bits)
        self.weight = source.weight
        self.scales, self.biases = _kernel_params(source.scales, source.biases)
        if "bias" in source:
            self.bias = source.bias.astype(mx.float32)
        self.freeze()

    @property
    def quant(self) -> QuantWeight:
        return QuantWeight(self.weight, self.scales, self.biases, self.bits, self.group_size)

    def __call__(self, x: mx.array) -> mx.array:
        y = linear(x, self.quant)
        return y + self.bias if "bias" in self else y


class InvariantQuantizedEmbedding(nn.Module):
    """``nn.QuantizedEmbedding``'s parameters: rows dequantized to float32 on lookup (each
    row on its own), ``as_linear`` (a tied LM head) through ``mtplx.quant.qmm``."""

    def __init__(self, source: nn.QuantizedEmbedding) -> None:
        super().__init__()
        self.group_size, self.bits = int(source.group_size), int(source.bits)
        self.weight = source.weight
        self.scales, self.biases = _kernel_params(source.scales, source.biases)
        self.num_embeddings = int(source.weight.shape[0])
        self.freeze()

    @property
    def quant(self) -> QuantWeight:
        return QuantWeight(self.weight, self.scales, self.biases, self.bits, self.group_size)

    def __call__(self, x: mx.array) -> mx.array:
        # One node of the extension on the CPU (mx.dequantize's bits: ``quant.embed_rows``)
        # where the gathers and ``mx.dequantize`` are ~35 on every forward.
        from mtplx.quant import embed_rows

        return embed_rows(x, self.weight, self.scales, self.biases, self.bits, self.group_size)

    def as_linear(self, x: mx.array) -> mx.array:
        return linear(x, self.quant)


def _kernel_takes(layer: Any) -> bool:
    return (
        getattr(layer, "mode", "affine") == "affine"
        and int(layer.bits) in KERNEL_BITS
        and int(layer.group_size) in KERNEL_GROUPS
    )


def _dequantized(layer: Any) -> nn.Module:
    weight = mx.dequantize(
        layer.weight,
        layer.scales,
        layer.get("biases"),
        group_size=layer.group_size,
        bits=layer.bits,
        mode=getattr(layer, "mode", "affine"),
    ).astype(mx.float32)
    if isinstance(layer, nn.QuantizedEmbedding):
        out_e = nn.Embedding(*weight.shape)
        out_e.weight = weight
        return out_e
    out = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in layer)
    out.weight = weight
    if "bias" in layer:
        out.bias = layer.bias.astype(mx.float32)
    return out


def _leaf_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(dotted path, module) of every leaf module of ``module`` (``tree_flatten`` without a
    destination returns this list; its stub also allows the dict form it fills when given one)."""
    return cast(
        list[tuple[str, nn.Module]],
        tree_flatten(module.leaf_modules(), is_leaf=nn.Module.is_module),
    )


def serve_quantized(module: nn.Module) -> int:
    """Swap ``module``'s quantized layers for the invariant-kernel ones (or float32 ones where
    the kernel does not take their format). Returns how many now run on the kernel."""
    swaps: list[tuple[str, nn.Module]] = []
    served = 0
    for path, layer in _leaf_modules(module):
        if isinstance(layer, nn.QuantizedLinear | nn.QuantizedEmbedding):
            if not _kernel_takes(layer):
                logger.info(
                    "%s: %s-bit %s (group %s) is not a kernel format: dequantized to float32",
                    path,
                    layer.bits,
                    getattr(layer, "mode", "affine"),
                    layer.group_size,
                )
                swaps.append((path, _dequantized(layer)))
                continue
            if isinstance(layer, nn.QuantizedLinear):
                swaps.append((path, InvariantQuantizedLinear(layer)))
            else:
                swaps.append((path, InvariantQuantizedEmbedding(layer)))
            served += 1
    if swaps:
        module.update_modules(tree_unflatten(swaps))
        mx.eval(module.parameters())
    return served


DRAFT_HEAD_BITS = 8


def quantize_draft_head(module: nn.Module) -> None:
    """Quantize an MTP head's float linear layers to 8-bit affine (group 32) when its trunk is
    served quantized: a draft step then reads a quarter of the bytes, so a drafting cycle
    stays close to a plain step. Drafts only propose tokens -- the verify decides, exactly --
    so this can change how many drafts are accepted, never which tokens are output.
    ``MTPLX_DRAFT_HEAD=f32`` keeps the head in float32."""
    if os.environ.get("MTPLX_DRAFT_HEAD", "q8").strip().lower() in ("f32", "float32"):
        return

    def predicate(_path: str, layer: nn.Module) -> bool:
        return type(layer) is nn.Linear and layer.weight.shape[-1] % 32 == 0

    nn.quantize(module, group_size=32, bits=DRAFT_HEAD_BITS, class_predicate=predicate)


def describe_weights(module: nn.Module) -> str:
    """The weight formats of ``module``'s products, most common first, e.g.
    ``affine q4/g32 (210), affine q8/g32 (1)`` or ``float32``."""
    counts: dict[str, int] = {}
    for _, layer in _leaf_modules(module):
        if isinstance(layer, InvariantQuantizedLinear | InvariantQuantizedEmbedding):
            name = f"affine q{layer.bits}/g{layer.group_size}"
        elif isinstance(layer, nn.QuantizedLinear | nn.QuantizedEmbedding):
            name = f"mlx {getattr(layer, 'mode', 'affine')} q{layer.bits}/g{layer.group_size}"
        elif isinstance(layer, nn.Linear | nn.Embedding):
            name = str(layer.weight.dtype).removeprefix("mlx.core.")
        else:
            continue
        counts[name] = counts.get(name, 0) + 1
    if not counts:
        return "none"
    ordered = sorted(counts.items(), key=lambda kv: -kv[1])
    if len(ordered) == 1:
        return ordered[0][0]
    return ", ".join(f"{name} ({count})" for name, count in ordered)
