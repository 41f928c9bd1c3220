"""The Qwen3-Next-form MTP head: Qwen3-Next / Qwen3.5 natively, and the generic head over any
other mlx-lm trunk (same ``mtp.*`` weight names, the trunk's own decoder-layer class).

One head step at position i (vllm/model_executor/models/qwen3_next_mtp.py)::

    x = fc(concat([pre_fc_norm_embedding(embed(x[i+1])), pre_fc_norm_hidden(h[i])]))
    x = layers[k](x)          # a full-attention decoder layer with its own KV cache
    h' = norm(x)              # the head's output hidden state (post-norm) ...
    logits = lm_head(h')      # ... which predicts x[i+2]

The embedding and LM head are the target's (shared), unless the weights carry their own
``mtp.lm_head.weight`` -- optionally over a reduced draft vocabulary ``mtp.draft_vocab``.
With ``mtp_num_hidden_layers`` > 1 head k uses ``layers[k]`` and shares fc / norms; deeper
drafts reuse the heads cyclically, as vLLM does (``spec_step_idx % num_mtp_layers``).
Recursion feeds ``h'`` (post-``norm``) back as the next step's hidden state.
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mtplx.lazy_cache import LazyKVCache
from mtplx.models.checkpoint import MTPTensors, text_config
from mtplx.models.families import NATIVE_NEXTN, strip_nextn_prefix
from mtplx.models.target import Trunk
from mtplx.models.weights import MTPWeightError, load_checked, stack_experts

# Qwen RMSNorm weights are stored zero-centred in Hugging Face checkpoints (the model
# multiplies by 1 + w); mlx-lm adds the 1 when it sanitizes the trunk, and so do we.
_QWEN_NORM_SUFFIXES = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)
_QWEN_HEAD_NORMS = {"pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"}


class NextNModule(nn.Module):
    """All weights of a Qwen3-Next-form MTP block (names = checkpoint names minus ``mtp.``)."""

    def __init__(self, trunk: Trunk, num_layers: int, head_vocab: int | None) -> None:
        super().__init__()
        size, eps = trunk.hidden_size, trunk.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(size, eps=eps)
        self.fc = nn.Linear(2 * size, size, bias=False)
        self.layers = [trunk.new_layer() for _ in range(num_layers)]
        self.norm = nn.RMSNorm(size, eps=eps)
        if head_vocab is not None:
            self.lm_head = nn.Linear(size, head_vocab, bias=False)


class NextNHead:
    """MTPHead k of a Qwen3-Next-form block."""

    def __init__(self, module: NextNModule, index: int, trunk: Trunk) -> None:
        self.module = module
        self.index = index
        self.trunk = trunk

    def make_cache(self) -> list[Any]:
        """One KV cache for the head's attention layer."""
        return [KVCache()]

    def make_lazy_cache(self) -> list[Any] | None:
        """A ``LazyKVCache`` for the head's layer where that layer reads its cache only as
        mlx-lm's llama attention does (RoPE at ``offset``, ``update_and_fetch``); else None."""
        return [LazyKVCache()] if self.trunk.arch == "llama" else None

    def __call__(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any]
    ) -> tuple[mx.array, mx.array]:
        """hidden [B, T, H], next_tokens [B, T] -> (logits [B, T, V'], hidden [B, T, H])."""
        m = self.module
        embedded = m.pre_fc_norm_embedding(self.trunk.embed(next_tokens))
        x = m.fc(mx.concatenate([embedded, m.pre_fc_norm_hidden(hidden)], axis=-1))
        mask = create_attention_mask(x, cache[0])
        x = m.layers[self.index](x, mask, cache[0])
        out = m.norm(x)
        logits = m.lm_head(out) if "lm_head" in m else self.trunk.lm_head(out)
        return logits, out


def build_nextn_heads(
    trunk: Trunk, tensors: MTPTensors, config: dict[str, Any]
) -> tuple[list[NextNHead], mx.array | None]:
    """The heads (and the draft vocabulary, if any) from Qwen3-Next-form MTP tensors."""
    local: dict[str, mx.array] = {}
    names: dict[str, str] = {}
    for key, value in tensors.arrays.items():
        stripped = strip_nextn_prefix(key)
        if stripped is None:
            raise MTPWeightError(f"unexpected MTP weight {key!r} in {tensors.where(key)}")
        name = stripped[len("mtp.") :]
        local[name], names[name] = value, key

    draft_vocab = local.pop("draft_vocab", None)
    if draft_vocab is not None:
        draft_vocab = _check_draft_vocab(draft_vocab, local, names, trunk, tensors)

    found = {int(m.group(1)) for n in local if (m := re.match(r"^layers\.(\d+)\.", n))}
    declared = text_config(config).get("mtp_num_hidden_layers")
    count = int(declared) if declared else (max(found) + 1 if found else 1)
    for name in local:
        match = re.match(r"^layers\.(\d+)\.", name)
        if match and int(match.group(1)) >= count:
            key = names[name]
            raise MTPWeightError(
                f"unexpected MTP weight {key!r} in {tensors.where(key)}: the config declares "
                f"mtp_num_hidden_layers={count}"
            )

    if trunk.arch in NATIVE_NEXTN and _zero_centred(tensors):
        for name, value in local.items():
            if name in _QWEN_HEAD_NORMS or name.endswith(_QWEN_NORM_SUFFIXES):
                local[name] = value + 1.0

    local, names = stack_experts(local, names)
    head_vocab = None
    if "lm_head.weight" in local:
        head_vocab = int(local["lm_head.weight"].shape[0])
    module = NextNModule(trunk, count, head_vocab)
    prefix = _common_prefix(tensors)
    load_checked(
        module,
        local,
        key_of=lambda name: names.get(name, f"{prefix}mtp.{name}"),
        where=tensors.where,
    )
    module.eval()
    return [NextNHead(module, k, trunk) for k in range(count)], draft_vocab


def _zero_centred(tensors: MTPTensors) -> bool:
    """Whether the Qwen MTP norms are stored zero-centred: tensors in the model shards follow
    the trunk (raw Hugging Face layout, or already rewritten by an mlx-lm conversion); separate
    MTP files are taken as extracted from the Hugging Face checkpoint."""
    in_model_files = [k for k in tensors.arrays if k not in tensors.sources]
    return tensors.raw_hf_layout if in_model_files else True


def _common_prefix(tensors: MTPTensors) -> str:
    for key in tensors.arrays:
        return key[: key.index("mtp.")]
    return ""


def _check_draft_vocab(
    draft_vocab: mx.array,
    local: dict[str, mx.array],
    names: dict[str, str],
    trunk: Trunk,
    tensors: MTPTensors,
) -> mx.array:
    key = next(k for k in tensors.arrays if k.endswith("mtp.draft_vocab"))
    if draft_vocab.ndim != 1 or draft_vocab.dtype not in (mx.int32, mx.int64, mx.uint32):
        raise MTPWeightError(f"{key!r} in {tensors.where(key)} must be a 1-D int32 array")
    if "lm_head.weight" not in local:
        raise MTPWeightError(
            f"missing MTP weight {key.replace('draft_vocab', 'lm_head.weight')!r}: a reduced "
            f"draft vocabulary ({key!r}) needs its own head"
        )
    rows = int(local["lm_head.weight"].shape[0])
    if rows != draft_vocab.shape[0]:
        raise MTPWeightError(
            f"{names['lm_head.weight']!r} has {rows} rows but {key!r} lists "
            f"{draft_vocab.shape[0]} tokens"
        )
    ids = draft_vocab.astype(mx.int32)
    if draft_vocab.size and (int(ids.min()) < 0 or int(ids.max()) >= trunk.vocab_size):
        raise MTPWeightError(f"{key!r} holds token ids outside 0..{trunk.vocab_size - 1}")
    return ids
