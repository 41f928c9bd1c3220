"""The target model over an mlx-lm trunk: logits AND the hidden states the MTP heads read, in
one forward; and the layer-skip draft that reuses the target's first layers.

Hidden-state convention (what ``TargetModel.__call__`` returns as ``hidden``): the trunk's
final hidden state AFTER its final norm, i.e. exactly the tensor the LM head multiplies. This
is what vLLM feeds the MTP heads: its speculative proposer passes the target forward's output,
and the target models return ``self.norm(hidden_states, residual)``
(vllm/model_executor/models/qwen3_next.py ``Qwen3NextModel.forward``,
vllm/model_executor/models/deepseek_v2.py ``DeepseekV2Model.forward``); the heads then apply
their own ``pre_fc_norm_hidden`` / ``hnorm`` to it (vllm/.../qwen3_next_mtp.py,
vllm/.../deepseek_mtp.py). mlx-lm's inner models return the same post-norm tensor.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache

from mtplx.models.base import LoadedModel, TargetModel
from mtplx.models.families import LLAMA_LIKE


@dataclass
class Trunk:
    """The parts of an mlx-lm model the wrappers and heads need."""

    model: nn.Module  # the mlx-lm Model (what make_prompt_cache takes)
    owner: nn.Module  # the module that holds `.model` and the LM head
    inner: nn.Module  # embed_tokens, layers, norm
    args: Any  # the (text) ModelArgs
    arch: str  # the mlx-lm module name, e.g. "llama"

    @classmethod
    def of(cls, model: nn.Module, arch: str) -> Trunk:
        """Find the parts in an mlx-lm model (multimodal wrappers: its language_model)."""
        owner = model.language_model if "language_model" in model else model
        return cls(model=model, owner=owner, inner=owner.model, args=owner.args, arch=arch)

    @property
    def vocab_size(self) -> int:
        return int(self.args.vocab_size)

    @property
    def hidden_size(self) -> int:
        return int(self.args.hidden_size)

    @property
    def rms_norm_eps(self) -> float:
        return float(getattr(self.args, "rms_norm_eps", 1e-6))

    def embed(self, tokens: mx.array) -> mx.array:
        """tokens [B, T] -> embeddings [B, T, H]."""
        return self.inner.embed_tokens(tokens)

    def lm_head(self, hidden: mx.array) -> mx.array:
        """hidden [B, T, H] (post-norm) -> logits [B, T, V]."""
        if "lm_head" in self.owner:
            return self.owner.lm_head(hidden)
        return self.inner.embed_tokens.as_linear(hidden)

    def new_layer(self) -> nn.Module:
        """A fresh decoder layer of the trunk's own class, shaped like its first full-attention
        layer (attention, not linear/recurrent; not sliding-window)."""
        layers = list(self.inner.layers)
        index = next(
            (
                i
                for i, layer in enumerate(layers)
                if not getattr(layer, "is_linear", False)
                and not getattr(layer, "use_sliding", False)
            ),
            None,
        )
        if index is None:
            raise ValueError(f"{self.arch}: the trunk has no full-attention layer to copy")
        layer_cls = type(layers[index])
        params = list(inspect.signature(layer_cls.__init__).parameters)[1:]
        kwargs: dict[str, Any] = {}
        for name in params[1:]:
            if name in ("layer_idx", "layer_id", "layer_index", "idx"):
                kwargs[name] = index
        return layer_cls(self.args, **kwargs)


class MLXTarget:
    """TargetModel over an mlx-lm model: ``(logits, post-norm hidden)`` in one forward, with
    the model's own mlx-lm cache objects (trimmable KVCache; non-trimmable ArraysCache for
    gated-delta layers)."""

    def __init__(self, trunk: Trunk) -> None:
        self.trunk = trunk
        self.vocab_size = trunk.vocab_size
        self.hidden_size = trunk.hidden_size

    def make_cache(self) -> list[Any]:
        """Fresh per-sequence mlx-lm cache objects, one per trunk layer."""
        return make_prompt_cache(self.trunk.model)

    def __call__(self, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """tokens [B, T] int -> (logits [B, T, V], hidden [B, T, H])."""
        hidden = self.trunk.inner(tokens, cache)
        return self.trunk.lm_head(hidden), hidden


class LayerSkipDraft:
    """The first N trunk layers + the final norm + the LM head, sharing the target's
    weights, with its own cache: a draft model that costs N/L of a target forward."""

    def __init__(self, trunk: Trunk, num_layers: int) -> None:
        self.trunk = trunk
        self.num_layers = num_layers
        self.vocab_size = trunk.vocab_size
        self.hidden_size = trunk.hidden_size

    def make_cache(self) -> list[Any]:
        """Cache objects for the first N layers."""
        return make_prompt_cache(self.trunk.model)[: self.num_layers]

    def __call__(self, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """tokens [B, T] int -> (logits [B, T, V], hidden [B, T, H])."""
        inner = self.trunk.inner
        h = inner.embed_tokens(tokens)
        window = getattr(inner, "sliding_window", None)
        for layer, layer_cache in zip(inner.layers[: self.num_layers], cache, strict=True):
            sliding = window if getattr(layer, "use_sliding", False) else None
            mask = create_attention_mask(h, layer_cache, window_size=sliding)
            h = layer(h, mask, layer_cache)
        h = inner.norm(h)
        return self.trunk.lm_head(h), h


def make_layer_skip_draft(loaded: LoadedModel, num_layers: int) -> TargetModel:
    """A draft model from the first ``num_layers`` layers of ``loaded``'s target (llama-like
    trunks only; N == L gives the target itself). Raises ValueError for other trunks or N
    outside 1..L."""
    target = loaded.target
    if not isinstance(target, MLXTarget):
        raise ValueError("layer-skip drafts need a target loaded by mtplx.models.load")
    trunk = target.trunk
    if trunk.arch not in LLAMA_LIKE:
        raise ValueError(
            f"layer-skip drafts need a llama-like trunk ({sorted(LLAMA_LIKE)}); "
            f"{loaded.model_type} ({trunk.arch}) is not one"
        )
    total = len(trunk.inner.layers)
    if not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(
            f"num_layers must be between 1 and {total} for a {total}-layer target, "
            f"got {num_layers!r}"
        )
    return LayerSkipDraft(trunk, num_layers)
