"""``load``: a checkpoint directory or hub repo -> ``LoadedModel`` (target, MTP heads,
tokenizer). mlx-lm builds the trunk and the tokenizer; the MTP tensors, which mlx-lm's
``sanitize`` drops, are set aside during its load and built into heads here."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtplx.models.base import LoadedModel, MTPHead
from mtplx.models.checkpoint import (
    CheckpointError,
    MTPTensors,
    check_weight_files,
    context_length,
    load_separate_mtp,
    model_files,
    mtp_files,
    read_config,
    resolve_model_path,
)
from mtplx.models.families import arch_of, mtp_key_predicate, mtp_layout
from mtplx.models.quantized import (
    describe_weights,
    quantize_draft_head,
    serve_quantized,
    weights_format,
)
from mtplx.models.stages import keep_stage
from mtplx.models.target import MLXTarget, Trunk
from mtplx.models.weights import settle_dtypes

logger = logging.getLogger(__name__)


def _raw_hf_layout(arch: str, weights: dict[str, mx.array]) -> bool:
    """Whether mlx-lm's sanitize will rewrite these Qwen trunk weights from the Hugging Face
    layout (the same tests it uses before adding 1 to the zero-centred norms)."""
    if arch == "qwen3_next":
        return any(
            k.startswith("model.layers.") and k.endswith(".mlp.experts.0.up_proj.weight")
            for k in weights
        )
    if arch in ("qwen3_5", "qwen3_5_moe"):
        return any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in weights.items())
    return True


def _load_trunk(
    directory: Path, config: dict[str, Any], arch: str, sink: MTPTensors, lazy: bool = False
) -> tuple[nn.Module, dict[str, Any]]:
    """mlx-lm's load_model, with the MTP tensors moved from its weights into ``sink``
    before the model's own sanitize runs. ``lazy``: weights are read when first
    evaluated (a pipeline stage never reads the layers it drops)."""
    from mlx_lm.utils import _get_classes, load_model

    is_mtp = mtp_key_predicate(config, arch)

    def classes(config: dict[str, Any]) -> tuple[type, type]:
        model_cls, args_cls = _get_classes(config)
        parent = getattr(model_cls, "sanitize", None)

        class WithMTPSetAside(model_cls):  # type: ignore[misc, valid-type]
            def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
                sink.raw_hf_layout = _raw_hf_layout(arch, weights)
                for key in [k for k in weights if is_mtp(k)]:
                    sink.arrays[key] = weights.pop(key)
                return parent(self, weights) if parent is not None else weights

        WithMTPSetAside.__name__ = model_cls.__name__
        WithMTPSetAside.__qualname__ = model_cls.__qualname__
        WithMTPSetAside.__module__ = model_cls.__module__
        return WithMTPSetAside, args_cls

    try:
        return load_model(directory, lazy=lazy, get_model_classes=classes)
    except ValueError as error:
        # mlx-lm's strict load names the offending parameter; say which checkpoint it was.
        raise CheckpointError(f"{directory}: {error}") from error


def build_heads(
    trunk: Trunk, tensors: MTPTensors, config: dict[str, Any]
) -> tuple[list[MTPHead], mx.array | None]:
    """The MTP heads of the trunk's family from its MTP tensors (none when there are none)."""
    if not tensors.arrays:
        return [], None
    layout = mtp_layout(trunk.arch)
    if layout == "deepseek_v3":
        from mtplx.models.mtp_deepseek import build_deepseek_v3_heads

        return list(build_deepseek_v3_heads(trunk, tensors, config)), None
    if layout == "deepseek_v4":
        from mtplx.models.mtp_deepseek_v4 import build_deepseek_v4_heads

        return list(build_deepseek_v4_heads(trunk, tensors, config)), None
    from mtplx.models.mtp_nextn import build_nextn_heads

    heads, draft_vocab = build_nextn_heads(trunk, tensors, config)
    return list(heads), draft_vocab


def load(
    model: str | Path,
    *,
    dequantize: bool | None = None,
    mtp_weights: str | Path | None = None,
    stage: tuple[int, int] | None = None,
) -> LoadedModel:
    """Load a checkpoint for the engine.

    ``model``: a local directory in the Hugging Face / mlx-lm layout (config.json,
    model*.safetensors shards with or without an index, tokenizer files, optional
    mtp*.safetensors) or a hub repo id. ``dequantize``: None = on the CPU backend, keep
    4/8-bit affine weights quantized and run their products on the batch-invariant kernel
    (``mtplx.quant``), unless ``MTPLX_WEIGHTS=f32`` or the kernel cannot be built (then
    dequantize them); cast bf16/f16 to float32; on a GPU keep them as they are.
    ``mtp_weights``: a separate MTP weight file or directory (default: the checkpoint's own
    mtp*.safetensors). Every MTP tensor must be consumed by a head: a missing or unexpected
    one raises ``MTPWeightError`` naming the key. ``stage`` (rank, number of ranks): keep
    only that pipeline stage's decoder layers (``mtplx.models.stages``); the others are
    never read.
    """
    from mlx_lm.utils import load_tokenizer

    directory = resolve_model_path(model)
    config = read_config(directory)
    arch = arch_of(config)
    if arch is None:
        raise CheckpointError(
            f"{directory / 'config.json'}: model_type {config['model_type']!r} is not "
            "supported by mlx-lm"
        )
    check_weight_files(model_files(directory))
    tensors = MTPTensors()
    extra = mtp_files(directory, mtp_weights)
    mlx_model, config = _load_trunk(directory, config, arch, tensors, lazy=stage is not None)
    load_separate_mtp(extra, mtp_key_predicate(config, arch), tensors)

    trunk = Trunk.of(mlx_model, arch)
    if stage is not None:
        keep_stage(trunk, *stage)
    cpu = mx.default_device() == mx.cpu
    if dequantize is None:
        dequantize = cpu and not _kernel_serves()
    settle_dtypes(mlx_model, dequantize=dequantize, to_float32=cpu)
    heads, draft_vocab = build_heads(trunk, tensors, config)
    for head in heads:
        settle_dtypes(head.module, dequantize=dequantize, to_float32=cpu)
    if cpu and not dequantize:
        # Quantized layers stay quantized, their products on the batch-invariant kernel.
        served = serve_quantized(mlx_model)
        for head in heads:
            if served:
                quantize_draft_head(head.module)
            serve_quantized(head.module)

    eos = config.get("eos_token_id")
    if eos is None and isinstance(config.get("text_config"), dict):
        eos = config["text_config"].get("eos_token_id")
    tokenizer = load_tokenizer(directory, eos_token_ids=eos)
    return LoadedModel(
        path=directory,
        model_type=str(config["model_type"]),
        target=MLXTarget(trunk),
        tokenizer=tokenizer,
        config=config,
        context_length=context_length(config),
        mtp_heads=heads,
        draft_vocab=draft_vocab,
        eos_token_ids=set(tokenizer.eos_token_ids),
        weights=describe_weights(mlx_model),
    )


def _kernel_serves() -> bool:
    """Whether the CPU serves quantized weights as they are: ``MTPLX_WEIGHTS`` is ``native``
    and the invariant kernel builds here (else they are dequantized, with the reason
    logged)."""
    if weights_format() == "f32":
        return False
    from mtplx.quant import Unavailable, load_extension

    try:
        load_extension()
    except Unavailable as exc:
        logger.warning("quantized weights are dequantized to float32: %s", exc)
        return False
    return True
