"""``inspect``: what a checkpoint is and how MTPLX can serve it, read from config.json and the
safetensors headers alone (no weights are loaded)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

from mtplx.models.checkpoint import (
    TensorInfo,
    check_weight_files,
    context_length,
    model_files,
    mtp_files,
    read_config,
    resolve_model_path,
    text_config,
)
from mtplx.models.families import (
    EXIT_CODES,
    LLAMA_LIKE,
    Tier,
    arch_of,
    count_mtp_layers,
    mtp_key_predicate,
    mtp_layout,
    mtp_tier,
)

_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


@dataclass
class InspectReport:
    """What ``mtplx inspect`` prints."""

    path: Path
    model_type: str
    architecture: str | None  # the mlx-lm module, None when mlx-lm has none
    parameter_count: int  # trunk parameters (quantized weights counted unpacked)
    dtype: str  # the most common tensor dtype, or e.g. "4-bit (group 64)"
    context_length: int
    mtp_layers: int
    mtp_layout: str | None  # nextn / deepseek_v3 / deepseek_v4, None without MTP weights
    mtp_files: list[Path]
    tier: Tier
    drafters: list[str]
    notes: list[str] = field(default_factory=list)
    # How the CPU serves the weights (mtplx.models.quantized, MTPLX_WEIGHTS) and with which
    # product kernel (mtplx.quant for quantized weights, the BLAS shim's for float32).
    weights: str = ""
    kernel: str = ""
    # The quantized kernel's rows (MTPLX_ACTIVATIONS): "int8" or "float32"; "" without it.
    activations: str = ""

    @property
    def exit_code(self) -> int:
        """0 verified, 10 arch-compatible-unverified, 11 no-MTP, 12 unsupported."""
        return EXIT_CODES[self.tier]

    def render(self) -> str:
        """The human-readable report."""
        lines = [
            f"model:            {self.path}",
            f"model_type:       {self.model_type}",
            f"architecture:     {self.architecture or '(not supported by mlx-lm)'}",
            f"parameters:       {self.parameter_count:,}",
            f"dtype:            {self.dtype}",
            f"weights served:   {self.weights}",
            f"kernel:           {self.kernel}"
            + (f" ({self.activations} activations)" if self.activations else ""),
            f"context length:   {self.context_length}",
            f"MTP layers:       {self.mtp_layers}"
            + (f" ({self.mtp_layout} layout)" if self.mtp_layout else ""),
        ]
        if self.mtp_files:
            lines.append(f"MTP files:        {', '.join(p.name for p in self.mtp_files)}")
        lines += [
            f"tier:             {self.tier.value}",
            f"drafters:         {', '.join(self.drafters) or '(none: mlx-lm cannot run it)'}",
        ]
        lines += [f"note:             {note}" for note in self.notes]
        return "\n".join(lines)


def _parameter_count(tensors: dict[str, TensorInfo], bits: int | None) -> int:
    total = 0
    for name, info in tensors.items():
        if name.endswith((".scales", ".biases")) and name.rsplit(".", 1)[0] + ".weight" in tensors:
            continue
        count = prod(info.shape)
        packed = name.rsplit(".", 1)[0] + ".scales" in tensors
        total += count * 32 // bits if packed and bits else count
    return total


def _dtype(tensors: dict[str, TensorInfo], config: dict[str, Any]) -> str:
    quantization = config.get("quantization")
    if isinstance(quantization, dict) and "bits" in quantization:
        return f"{quantization['bits']}-bit (group {quantization.get('group_size', '?')})"
    counts = Counter(info.dtype for info in tensors.values())
    if not counts:
        return "unknown"
    name = counts.most_common(1)[0][0]
    return _DTYPE_NAMES.get(name, name.lower())


def inspect(model: str | Path) -> InspectReport:
    """Report architecture, size, dtype, context, MTP layers, tier and usable drafters.

    Raises FileNotFoundError / CheckpointError (exit code 2 in the CLI) for a checkpoint
    that cannot be read at all."""
    directory = resolve_model_path(model)
    config = read_config(directory)
    arch = arch_of(config)
    trunk_tensors = check_weight_files(model_files(directory))
    extra = mtp_files(directory)
    extra_tensors = check_weight_files(extra)
    notes: list[str] = []
    is_mtp = mtp_key_predicate(config, arch)
    mtp_keys = [k for k in trunk_tensors if is_mtp(k)] + list(extra_tensors)
    layers = count_mtp_layers(mtp_keys, config, arch) if arch else 0
    tier = mtp_tier(arch, bool(mtp_keys))
    if arch is None:
        notes.append(f"mlx-lm has no implementation of model_type {config['model_type']!r}")
    elif tier is Tier.UNVERIFIED:
        notes.append("MTP head loads and runs, but has not been checked against a reference")
    drafters: list[str] = []
    if arch is not None:
        if mtp_keys:
            drafters.append("mtp")
        if arch in LLAMA_LIKE:
            drafters.append("draft_model (layer-skip)")
        drafters += ["ngram", "none"]
    trunk_only = {k: v for k, v in trunk_tensors.items() if not is_mtp(k)}
    bits = (config.get("quantization") or {}).get("bits")
    weights, kernel = served_weights(text_config(config))
    return InspectReport(
        path=directory,
        model_type=str(config["model_type"]),
        architecture=arch,
        parameter_count=_parameter_count(trunk_only, bits),
        dtype=_dtype(trunk_only, text_config(config)),
        context_length=context_length(config),
        mtp_layers=layers,
        mtp_layout=mtp_layout(arch) if mtp_keys else None,
        mtp_files=extra,
        tier=tier,
        drafters=drafters,
        notes=notes,
        weights=weights,
        kernel=kernel,
        activations=_activations(kernel),
    )


def _activations(kernel: str) -> str:
    """The quantized kernel's activations mode when it serves the products, else ""."""
    if not kernel.startswith("mtplx-invariant-") or "BLAS" in kernel:
        return ""
    from mtplx.models.quantized import activations_format

    return activations_format()


def served_weights(config: dict[str, Any]) -> tuple[str, str]:
    """(How the CPU serves a checkpoint's weights, the products' kernel), from its config's
    ``quantization`` entry and ``MTPLX_WEIGHTS``, without loading it."""
    import mlx.core as mx

    from mtplx.models.quantized import KERNEL_BITS, KERNEL_GROUPS, weights_format

    blas = "mtplx-invariant-f32 (BLAS shim)" if mx.default_device() == mx.cpu else "mlx"
    quantization = config.get("quantization")
    if not isinstance(quantization, dict) or "bits" not in quantization:
        return "float32" if mx.default_device() == mx.cpu else "as stored", blas
    bits, group = quantization["bits"], quantization.get("group_size", 64)
    mode = quantization.get("mode", "affine")
    if mx.default_device() != mx.cpu:
        return f"{bits}-bit {mode} (group {group}), as stored", "mlx"
    if weights_format() == "f32":
        return "float32 (dequantized: MTPLX_WEIGHTS=f32)", blas
    if mode != "affine" or bits not in KERNEL_BITS or group not in KERNEL_GROUPS:
        return f"float32 (dequantized: {bits}-bit {mode} group {group} is no kernel format)", blas
    from mtplx.quant import quant_info

    info = quant_info()
    if not info.available:
        return f"float32 (dequantized: {info.reason})", blas
    return f"{bits}-bit affine (group {group}), served quantized", info.kernel
