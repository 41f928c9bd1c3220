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

import itertools
import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from mtplx.lazy_cache import LazyKVCache
from mtplx.models.base import forward_each, forward_packed, logits_at, pack_rows, positions
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
        # The head step on the trunk's fused kernels (``mtplx.models.fused_head.fuse_head``
        # sets it where they serve the head; the MTP drafter does). ``fuses_layer`` False
        # runs mlx-lm's layer, e.g. to compare the two.
        self.fused: Any = None
        self.fuse_checked = False  # whether ``fuse_head`` has looked at this head
        self.fuses_layer = True

    def fused_parts(self) -> Any:
        """The head's fused parts (``mtplx.models.fused_head.FusedHead``), None where none
        were set or ``fuses_layer`` is off."""
        return self.fused if self.fuses_layer else None

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
        fused = self.fused_parts()
        if fused is not None and hidden.shape[0] == 1:
            return self._forward_fused(fused, [hidden], [next_tokens], [cache])[0]
        m = self.module
        embedded = m.pre_fc_norm_embedding(self.trunk.embed(next_tokens))
        x = m.fc(mx.concatenate([embedded, m.pre_fc_norm_hidden(hidden)], axis=-1))
        mask = create_attention_mask(x, cache[0])
        x = m.layers[self.index](x, mask, cache[0])
        out = m.norm(x)
        logits = m.lm_head(out) if "lm_head" in m else self.trunk.lm_head(out)
        return logits, out

    def forward_rows(
        self,
        hidden: list[mx.array],
        next_tokens: list[mx.array],
        caches: list[list[Any]],
        at: list[mx.array] | None = None,
    ) -> list[tuple[mx.array, mx.array]]:
        """Many rows' head steps in one forward: every product (fc, projections, MLP, LM
        head) over the rows' tokens packed into one [1, N] sequence, so each weight is read
        once for all rows; RoPE, the cache and attention per row, as ``__call__`` runs them.
        The batch-invariant products sum each output element in the same order whatever
        the row count, so a row's outputs are bitwise those of ``__call__`` alone. Heads
        over other layers than mlx-lm's llama block run row by row. With ``at`` the fused
        step projects only those positions' hidden states onto the (draft) vocabulary."""
        if not _packs(self.module.layers[self.index]):
            return logits_at(forward_each(self, hidden, next_tokens, caches), at)
        fused = self.fused_parts()
        if fused is None:
            outputs = forward_packed(self, self._forward_packed, hidden, next_tokens, caches)
            return logits_at(outputs, at)
        results: list[tuple[mx.array, mx.array]] = []
        for pack in pack_rows(hidden, next_tokens, caches):  # a row alone is ``__call__``'s
            pack_at = None if at is None else at[len(results) : len(results) + len(pack[0])]
            results.extend(self._forward_fused(fused, *pack, at=pack_at))
        return results

    def _forward_packed(
        self, hidden: list[mx.array], next_tokens: list[mx.array], caches: list[list[Any]]
    ) -> list[tuple[mx.array, mx.array]]:
        """``forward_rows`` of rows whose tokens together fit the products' row limit."""
        fused = self.fused_parts()
        if fused is not None:
            return self._forward_fused(fused, hidden, next_tokens, caches)
        m = self.module
        layer = m.layers[self.index]
        sizes = [int(t.shape[1]) for t in next_tokens]
        tokens = mx.concatenate(next_tokens, axis=1)  # [1, N]
        embedded = m.pre_fc_norm_embedding(self.trunk.embed(tokens))
        normed = m.pre_fc_norm_hidden(mx.concatenate(hidden, axis=1))
        x = m.fc(mx.concatenate([embedded, normed], axis=-1))  # [1, N, H]
        attended = _attention_rows(layer.self_attn, layer.input_layernorm(x), sizes, caches)
        h = x + attended
        x = h + layer.mlp(layer.post_attention_layernorm(h))
        out = m.norm(x)
        logits = m.lm_head(out) if "lm_head" in m else self.trunk.lm_head(out)
        return _split(logits, out, sizes)

    def _forward_fused(
        self,
        fused: Any,
        hidden: list[mx.array],
        next_tokens: list[mx.array],
        caches: list[list[Any]],
        at: list[mx.array] | None = None,
    ) -> list[tuple[mx.array, mx.array]]:
        """``_forward_packed`` (one row or several) through the fused parts
        (``mtplx.models.fused_head``): the same ops and bits in a few graph nodes each for
        the fc input, the layer and the output."""
        sizes = [int(t.shape[1]) for t in next_tokens]
        tokens = mx.concatenate(next_tokens, axis=1) if len(sizes) > 1 else next_tokens[0]
        states = mx.concatenate(hidden, axis=1) if len(sizes) > 1 else hidden[0]
        x = fused.into(tokens, states)  # [1, N, H]
        x = fused.layer(x, sizes, caches)
        if at is not None:
            return self._project_at(fused, x, sizes, at)
        logits, out = fused.out(x)
        if logits is None:  # the trunk's head (a tied embedding, or its own lm_head)
            logits = self.trunk.lm_head(out)
        return _split(logits, out, sizes)

    def _project_at(
        self, fused: Any, x: mx.array, sizes: list[int], at: list[mx.array]
    ) -> list[tuple[mx.array, mx.array]]:
        """The head's output over packed rows x [1, N, H]: every row's normed hidden states,
        and the logits [1, 1, V'] of row i's position ``at[i]`` only (the LM head's product
        is batch-invariant: the bits that position has among all)."""
        starts = itertools.accumulate(sizes[:-1], initial=0)
        rows = (
            at[0] if len(at) == 1 else mx.stack([a + s for a, s in zip(at, starts, strict=True)])
        )  # [] or [R] int32: the wanted positions among the N packed ones
        logits, out = fused.out_at(x, rows)
        if logits is None:  # the trunk's head (a tied embedding, or its own lm_head)
            logits = self.trunk.lm_head(positions(out, rows))
        if len(sizes) == 1:
            return [(logits, out)]
        outputs = _split(out, out, sizes)
        return [(logits[:, i : i + 1], row_out) for i, (_, row_out) in enumerate(outputs)]


def _split(logits: mx.array, out: mx.array, sizes: list[int]) -> list[tuple[mx.array, mx.array]]:
    """Packed [1, N, ...] outputs -> each row's (logits, hidden)."""
    if len(sizes) == 1:
        return [(logits, out)]
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [(logits[:, a:b], out[:, a:b]) for a, b in itertools.pairwise(bounds)]


def _packs(layer: nn.Module) -> bool:
    """Whether ``forward_rows`` can split ``layer`` at its attention: mlx-lm's llama block
    exactly (a subclass may compute otherwise)."""
    return (
        type(layer) is llama.TransformerBlock
        and type(layer.self_attn) is llama.Attention
        and type(layer.mlp) is llama.MLP
    )


def _attention_rows(
    attn: llama.Attention, x: mx.array, sizes: list[int], caches: list[list[Any]]
) -> mx.array:
    """mlx-lm's llama attention over packed rows: the q / k / v and output products over
    all of x [1, N, D]; RoPE at each row's offset, its cache and its attention alone, the
    same ops in the same shapes as ``llama.Attention.__call__`` on that row."""
    queries, keys, values = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    outputs = []
    start = 0
    for size, cache in zip(sizes, caches, strict=True):
        end = start + size
        q = queries[:, start:end].reshape(1, size, attn.n_heads, -1).transpose(0, 2, 1, 3)
        k = keys[:, start:end].reshape(1, size, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = values[:, start:end].reshape(1, size, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        layer_cache = cache[0]
        mask = create_attention_mask(x[:, start:end], layer_cache)
        q = attn.rope(q, offset=layer_cache.offset)
        k = attn.rope(k, offset=layer_cache.offset)
        k, v = layer_cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(
            q, k, v, cache=layer_cache, scale=attn.scale, mask=mask
        )  # [1, heads, T_i, d]
        outputs.append(out.transpose(0, 2, 1, 3).reshape(1, size, -1))
        start = end
    return attn.o_proj(mx.concatenate(outputs, axis=1))


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
