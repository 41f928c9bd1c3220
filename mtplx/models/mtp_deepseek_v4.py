"""The DeepSeek-V4 MTP module (``mtp.{i}.*``) over mlx-lm's ``deepseek_v41`` trunk.

Tier: arch-compatible-unverified. The weights (e_proj, h_proj, enorm, hnorm, norm,
hc_head_{fn,base,scale} and a decoder block with hyper-connections) load and run, but we have
no reference output to check against. One approximation is known: the published head reads the
trunk's un-collapsed hyper-connection streams, while the TargetModel contract hands every head
the collapsed post-norm hidden state; here that state is spread over the ``hc_mult`` streams.

One step at position i::

    x = e_proj(enorm(embed(x[i+1]))) + h_proj(hnorm(h[i]))
    streams = block(x on every stream)       # window-attention layer, its own LayerCache
    y = hc_head(streams)                     # sigmoid-weighted mix of the streams
    logits = lm_head(norm(y)); y (pre-norm) is the hidden state the next depth reads
"""

from __future__ import annotations

import functools
import itertools
import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtplx.models.base import forward_each, forward_packed, logits_at
from mtplx.models.checkpoint import MTPTensors, text_config
from mtplx.models.target import Trunk
from mtplx.models.weights import MTPWeightError, load_checked

_OWN = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.", "hc_head_")


class DeepseekV4MTPModule(nn.Module):
    """One DeepSeek-V4 MTP module (names = checkpoint names minus ``mtp.{i}.``, the block's
    under ``block.`` in mlx-lm's naming)."""

    def __init__(self, trunk: Trunk, layer_id: int) -> None:
        super().__init__()
        from mlx_lm.models.deepseek_v41 import DecoderLayer

        args = trunk.args
        size, eps, hc = trunk.hidden_size, trunk.rms_norm_eps, int(args.hc_mult)
        self.e_proj = nn.Linear(size, size, bias=False)
        self.h_proj = nn.Linear(size, size, bias=False)
        self.enorm = nn.RMSNorm(size, eps=eps)
        self.hnorm = nn.RMSNorm(size, eps=eps)
        self.norm = nn.RMSNorm(size, eps=eps)
        self.hc_head_fn = mx.zeros((hc, hc * size), dtype=mx.float32)
        self.hc_head_base = mx.zeros((hc,), dtype=mx.float32)
        self.hc_head_scale = mx.ones((1,), dtype=mx.float32)
        self.block = DecoderLayer(args, layer_id)
        self.hc_mult, self.hc_eps, self.norm_eps = hc, float(args.hc_eps), eps

    def collapse(self, streams: mx.array) -> mx.array:
        """streams [B, T, hc, H] -> [B, T, H]: the head's own hyper-connection mix."""
        flat = streams.reshape(*streams.shape[:2], -1).astype(mx.float32)
        flat = mx.fast.rms_norm(flat, weight=None, eps=self.norm_eps)
        mix = (flat @ self.hc_head_fn.T) * self.hc_head_scale + self.hc_head_base
        weights = mx.sigmoid(mix) + self.hc_eps
        out = mx.sum(weights[..., None] * streams.astype(mx.float32), axis=2)
        return out.astype(streams.dtype)


class DeepseekV4MTPHead:
    """MTPHead over one DeepSeek-V4 MTP module."""

    def __init__(self, module: DeepseekV4MTPModule, trunk: Trunk) -> None:
        self.module = module
        self.trunk = trunk

    def make_cache(self) -> list[Any]:
        """The block's window cache (mlx-lm's LayerCache: not trimmable, snapshot it)."""
        from mlx_lm.models.deepseek_v41 import LayerCache

        return [LayerCache(int(self.trunk.args.sliding_window))]

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
        """Many rows' head steps in one forward: the input projections, the block's
        hyper-connection mixes, norms and MLP (MoE: each token routed alone) and the head
        over the rows' tokens packed into one [1, N] sequence, so each weight is read once
        for all rows; the block's window attention per row over its own cache, as
        ``__call__`` runs it. The batch-invariant products sum each output element in the
        same order whatever the row count, so a row's outputs are bitwise those of
        ``__call__`` alone. A block of another class than mlx-lm's (which this splits at its
        attention) runs row by row."""
        from mlx_lm.models.deepseek_v41 import DecoderLayer

        if type(self.module.block) is not DecoderLayer:
            return logits_at(forward_each(self, hidden, next_tokens, caches), at)
        outputs = forward_packed(self, self._forward_packed, hidden, next_tokens, caches)
        return logits_at(outputs, at)  # ``at``: the logits of every position, then taken

    def __call__(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any]
    ) -> tuple[mx.array, mx.array]:
        """hidden [B, T, H], next_tokens [B, T] -> (logits [B, T, V], hidden [B, T, H])."""
        m = self.module
        x = m.e_proj(m.enorm(self.trunk.embed(next_tokens))) + m.h_proj(m.hnorm(hidden))
        batch, length, size = x.shape
        layer_cache = cache[0]
        window_idx = self._window(layer_cache, batch, length)
        streams = mx.broadcast_to(x[:, :, None, :], (batch, length, m.hc_mult, size))
        streams, _ = m.block(
            streams,
            self._first_stream(batch, length),
            start_pos=layer_cache.offset,
            window_idx=window_idx,
            cache=layer_cache,
            shared={},
        )
        out = m.collapse(streams)
        return self.trunk.lm_head(m.norm(out)), out

    def _forward_packed(
        self, hidden: list[mx.array], next_tokens: list[mx.array], caches: list[list[Any]]
    ) -> list[tuple[mx.array, mx.array]]:
        """``forward_rows`` of rows whose tokens together fit the products' row limit:
        mlx-lm's ``DecoderLayer.__call__`` with its attention run row by row."""
        from mlx_lm.models.deepseek_v41 import _collapse, _expand

        m = self.module
        block = m.block
        sizes = [int(t.shape[1]) for t in next_tokens]
        bounds = list(itertools.pairwise(itertools.accumulate(sizes, initial=0)))
        tokens = mx.concatenate(next_tokens, axis=1)  # [1, N]
        x = m.e_proj(m.enorm(self.trunk.embed(tokens)))
        x = x + m.h_proj(m.hnorm(mx.concatenate(hidden, axis=1)))  # [1, N, H]
        _, length, size = x.shape
        streams = mx.broadcast_to(x[:, :, None, :], (1, length, m.hc_mult, size))
        attn_pre, attn_post, attn_comb = block.attn_hc(streams)
        normed = block.input_layernorm(_collapse(streams, self._first_stream(1, length)))
        attended = []
        for (start, end), cache in zip(bounds, caches, strict=True):
            layer_cache = cache[0]
            attended.append(
                block.self_attn(
                    normed[:, start:end],
                    start_pos=layer_cache.offset,
                    window_idx=self._window(layer_cache, 1, end - start),
                    cache=layer_cache,
                    shared={},
                )
            )  # [1, T_i, H]
        streams = _expand(mx.concatenate(attended, axis=1), streams, attn_post, attn_comb)
        _, ffn_post, ffn_comb = block.ffn_hc(streams)
        h = block.mlp(block.post_attention_layernorm(_collapse(streams, attn_pre)))
        streams = _expand(h, streams, ffn_post, ffn_comb)
        out = m.collapse(streams)
        logits = self.trunk.lm_head(m.norm(out))
        return [(logits[:, start:end], out[:, start:end]) for start, end in bounds]

    def _window(self, layer_cache: Any, batch: int, length: int) -> mx.array:
        """The window positions the block's attention reads for ``length`` new tokens after
        what ``layer_cache`` holds: [batch, ...] (mlx-lm's ``_window_indices``)."""
        from mlx_lm.models.deepseek_v41 import _window_indices

        previous = 0 if layer_cache.window is None else layer_cache.window.shape[1]
        window_idx = _window_indices(
            previous=previous, length=length, window=int(self.trunk.args.sliding_window)
        )
        return mx.broadcast_to(window_idx, (batch, *window_idx.shape))

    def _first_stream(self, batch: int, length: int) -> mx.array:
        """[batch, length, hc] float32: the block's input mix, all weight on the first
        stream (every stream holds the same input)."""
        pre_mix = mx.zeros((batch, length, self.module.hc_mult), dtype=mx.float32)
        pre_mix[..., 0] = 1.0
        return pre_mix


def build_deepseek_v4_heads(
    trunk: Trunk, tensors: MTPTensors, config: dict[str, Any]
) -> list[DeepseekV4MTPHead]:
    """One head per ``mtp.{i}`` module (``num_nextn_predict_layers``, else as found)."""
    first = int(text_config(config)["num_hidden_layers"])
    from mlx_lm.models.deepseek_v41 import Model as V41Model

    per_module: dict[int, dict[str, str]] = {}
    for key in tensors.arrays:
        match = re.match(r"^mtp\.(\d+)\.(.+)$", key)
        if match is None:
            raise MTPWeightError(f"unexpected MTP weight {key!r} in {tensors.where(key)}")
        per_module.setdefault(int(match.group(1)), {})[match.group(2)] = key
    declared = text_config(config).get("num_nextn_predict_layers")
    count = int(declared) if declared else max(per_module) + 1
    extra = sorted(i for i in per_module if i >= count)
    if extra:
        key = next(iter(per_module[extra[0]].values()))
        raise MTPWeightError(
            f"unexpected MTP weight {key!r} in {tensors.where(key)}: the config declares "
            f"num_nextn_predict_layers={count}"
        )

    heads = []
    for index in range(count):
        keys = per_module.get(index, {})
        local: dict[str, mx.array] = {}
        names: dict[str, str] = {}
        block_raw: dict[str, mx.array] = {}
        for name, key in keys.items():
            if name.startswith(_OWN):
                local[name], names[name] = tensors.arrays[key], key
            else:
                block_raw[f"layers.{first + index}.{name}"] = tensors.arrays[key]
        # mlx-lm's own sanitize renames and stacks the block's tensors (published naming).
        prefix = f"model.layers.{first + index}."
        # sanitize reads only the model's args: the trunk's own model stands in for V41Model.
        sanitized = V41Model.sanitize(trunk.model, block_raw)  # type: ignore[arg-type]
        for name, value in sanitized.items():
            local_name = "block." + name.removeprefix(prefix)
            local[local_name], names[local_name] = value, f"mtp.{index}.{name.removeprefix(prefix)}"
        module = DeepseekV4MTPModule(trunk, first + index)
        load_checked(
            module,
            local,
            key_of=functools.partial(_checkpoint_key, names, index),
            where=tensors.where,
        )
        module.eval()
        heads.append(DeepseekV4MTPHead(module, trunk))
    return heads


def _checkpoint_key(names: dict[str, str], index: int, name: str) -> str:
    """The checkpoint key a module parameter was loaded from (for error messages)."""
    return names.get(name, f"mtp.{index}.{name.removeprefix('block.')}")
