"""The DeepSeek-V3 MTP module (``model.layers.{num_hidden_layers + i}``).

One step at position i (DeepSeek-V3 report, section 2.2; vllm/.../deepseek_mtp.py)::

    x = eh_proj(concat([enorm(embed(x[i+1])), hnorm(h[i])]))
    x = block(x)                         # a full DeepSeek-V3 decoder layer (MLA, MoE)
    logits = shared_head.head(shared_head.norm(x))
    # x (pre-norm) is the hidden state the next depth reads, as in vLLM, whose
    # DeepSeekMultiTokenPredictorLayer returns the block output and applies
    # shared_head.norm only when it computes logits.

Each module may carry its own ``embed_tokens`` / ``shared_head.head`` copies (the published
checkpoint does); they are used when present, else the target's are shared.
"""

from __future__ import annotations

import functools
import itertools
import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mtplx.models.base import forward_each, forward_packed, logits_at
from mtplx.models.checkpoint import MTPTensors, text_config
from mtplx.models.target import Trunk
from mtplx.models.weights import MTPWeightError, load_checked, stack_experts

_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


class SharedHead(nn.Module):
    def __init__(self, size: int, eps: float, vocab: int | None) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(size, eps=eps)
        if vocab is not None:
            self.head = nn.Linear(size, vocab, bias=False)


class DeepseekMTPModule(nn.Module):
    """One DeepSeek-V3 MTP module."""

    def __init__(self, trunk: Trunk, layer_idx: int, own_head: bool, own_embed: bool) -> None:
        super().__init__()
        from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer

        size, eps = trunk.hidden_size, trunk.rms_norm_eps
        self.enorm = nn.RMSNorm(size, eps=eps)
        self.hnorm = nn.RMSNorm(size, eps=eps)
        self.eh_proj = nn.Linear(2 * size, size, bias=False)
        self.block = DeepseekV3DecoderLayer(trunk.args, layer_idx)
        self.shared_head = SharedHead(size, eps, trunk.vocab_size if own_head else None)
        if own_embed:
            self.embed_tokens = nn.Embedding(trunk.vocab_size, size)


class DeepseekMTPHead:
    """MTPHead over one DeepSeek-V3 MTP module."""

    def __init__(self, module: DeepseekMTPModule, trunk: Trunk) -> None:
        self.module = module
        self.trunk = trunk

    def make_cache(self) -> list[Any]:
        """One KV cache (MLA latent + rope key) for the module's block."""
        return [KVCache()]

    def make_lazy_cache(self) -> None:
        """None: the block reads its cache in ways a lazy cache does not model."""
        return None

    def forward_rows(
        self,
        hidden: list[mx.array],
        next_tokens: list[mx.array],
        caches: list[list[Any]],
        at: list[mx.array] | None = None,
    ) -> list[tuple[mx.array, mx.array]]:
        """Many rows' head steps in one forward: eh_proj, the block's norms and MLP (MoE:
        each token routed alone) and the head over the rows' tokens packed into one [1, N]
        sequence, so each weight is read once for all rows; the block's attention (MLA)
        per row over its own cache, as ``__call__`` runs it. The batch-invariant products
        sum each output element in the same order whatever the row count, so a row's
        outputs are bitwise those of ``__call__`` alone. A block of another class than
        mlx-lm's (which this splits at its attention) runs row by row."""
        from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer

        if type(self.module.block) is not DeepseekV3DecoderLayer:
            return logits_at(forward_each(self, hidden, next_tokens, caches), at)
        outputs = forward_packed(self, self._forward_packed, hidden, next_tokens, caches)
        return logits_at(outputs, at)  # ``at``: the logits of every position, then taken

    def _forward_packed(
        self, hidden: list[mx.array], next_tokens: list[mx.array], caches: list[list[Any]]
    ) -> list[tuple[mx.array, mx.array]]:
        """``forward_rows`` of rows whose tokens together fit the products' row limit:
        mlx-lm's ``DeepseekV3DecoderLayer.__call__`` with its attention run row by row."""
        m = self.module
        block = m.block
        sizes = [int(t.shape[1]) for t in next_tokens]
        bounds = list(itertools.pairwise(itertools.accumulate(sizes, initial=0)))
        embed = m.embed_tokens if "embed_tokens" in m else self.trunk.inner.embed_tokens
        tokens = mx.concatenate(next_tokens, axis=1)  # [1, N]
        x = mx.concatenate(
            [m.enorm(embed(tokens)), m.hnorm(mx.concatenate(hidden, axis=1))], axis=-1
        )
        x = m.eh_proj(x)  # [1, N, H]
        normed = block.input_layernorm(x)
        attended = []
        for (start, end), cache in zip(bounds, caches, strict=True):
            row = normed[:, start:end]
            mask = create_attention_mask(row, cache[0], return_array=True)
            attended.append(block.self_attn(row, mask, cache[0]))  # [1, T_i, H]
        h = x + mx.concatenate(attended, axis=1)
        x = h + block.mlp(block.post_attention_layernorm(h))
        normed = m.shared_head.norm(x)
        head = m.shared_head
        logits = head.head(normed) if "head" in head else self.trunk.lm_head(normed)
        return [(logits[:, start:end], x[:, start:end]) for start, end in bounds]

    def __call__(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any]
    ) -> tuple[mx.array, mx.array]:
        """hidden [B, T, H], next_tokens [B, T] -> (logits [B, T, V], hidden [B, T, H])."""
        m = self.module
        embed = m.embed_tokens if "embed_tokens" in m else self.trunk.inner.embed_tokens
        x = mx.concatenate([m.enorm(embed(next_tokens)), m.hnorm(hidden)], axis=-1)
        x = m.eh_proj(x)
        mask = create_attention_mask(x, cache[0], return_array=True)
        x = m.block(x, mask, cache[0])
        normed = m.shared_head.norm(x)
        head = m.shared_head
        logits = head.head(normed) if "head" in head else self.trunk.lm_head(normed)
        return logits, x


def _split_kv_b(local: dict[str, mx.array], names: dict[str, str], args: Any) -> None:
    """kv_b_proj -> the embed_q / unembed_out pair of mlx-lm's MLA (as its sanitize does)."""
    name = "block.self_attn.kv_b_proj.weight"
    if name not in local:
        return
    if "block.self_attn.kv_b_proj.scales" in local:
        raise MTPWeightError(
            f"quantized {names[name]!r} is not supported in MTP weights; store it unquantized"
        )
    key = names.pop(name)
    value = local.pop(name)
    heads = args.num_attention_heads
    value = value.reshape(heads, args.qk_nope_head_dim + args.v_head_dim, -1)
    wk = mx.contiguous(value[:, : args.qk_nope_head_dim, :].swapaxes(-1, -2))
    wv = mx.contiguous(value[:, args.qk_nope_head_dim :, :])
    local["block.self_attn.embed_q.weight"] = wk
    local["block.self_attn.unembed_out.weight"] = wv
    names["block.self_attn.embed_q.weight"] = key
    names["block.self_attn.unembed_out.weight"] = key


def build_deepseek_v3_heads(
    trunk: Trunk, tensors: MTPTensors, config: dict[str, Any]
) -> list[DeepseekMTPHead]:
    """One head per ``num_nextn_predict_layers`` module."""
    first = int(text_config(config)["num_hidden_layers"])
    count = int(text_config(config).get("num_nextn_predict_layers") or 0)
    per_layer: dict[int, dict[str, str]] = {}
    for key in tensors.arrays:
        if "rotary_emb.inv_freq" in key:
            continue
        if key.endswith("_scale_inv"):
            raise MTPWeightError(
                f"fp8 MTP weight {key!r} in {tensors.where(key)} is not supported; "
                "dequantize the checkpoint first"
            )
        match = re.match(r"^model\.layers\.(\d+)\.(.+)$", key)
        index = int(match.group(1)) - first if match else -1
        if match is None or not 0 <= index < max(count, 1) or (count == 0):
            raise MTPWeightError(
                f"unexpected MTP weight {key!r} in {tensors.where(key)}: the config declares "
                f"num_nextn_predict_layers={count}"
            )
        per_layer.setdefault(index, {})[match.group(2)] = key

    heads = []
    for index in range(count):
        keys = per_layer.get(index, {})
        local: dict[str, mx.array] = {}
        names: dict[str, str] = {}
        for name, key in keys.items():
            local_name = name if name.startswith(_OWN) else f"block.{name}"
            local[local_name], names[local_name] = tensors.arrays[key], key
        _split_kv_b(local, names, trunk.args)
        local, names = stack_experts(local, names)
        module = DeepseekMTPModule(
            trunk,
            first + index,
            own_head="shared_head.head.weight" in local,
            own_embed="embed_tokens.weight" in local,
        )
        prefix = f"model.layers.{first + index}."
        load_checked(
            module,
            local,
            key_of=functools.partial(_checkpoint_key, names, prefix),
            where=tensors.where,
        )
        module.eval()
        heads.append(DeepseekMTPHead(module, trunk))
    return heads


def _checkpoint_key(names: dict[str, str], prefix: str, name: str) -> str:
    """The checkpoint key a module parameter was loaded from (for error messages)."""
    return names.get(name, prefix + name.removeprefix("block."))
