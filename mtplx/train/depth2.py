"""Teacher-forced depth-2 forward of a llama-layer MTP head, with the attention context the
drafter really has.

At inference the second draft step at position i feeds (out1[i], d1) -- the head's own post-norm
output and the first draft token -- and its query attends to the head's KV cache: the
depth-1 entries of pairs 0..i (rope positions 0..i) plus its own new entry (position i+1).
A plain second causal pass over the out1 stream would attend to depth-2 entries instead, so
this module computes that attention explicitly: scores against the depth-1 keys (masked to
j <= i) and the entry's own key, one softmax over both.
"""

from __future__ import annotations

import mlx.core as mx

from mtplx.models.mtp_nextn import NextNModule
from mtplx.models.target import Trunk


def _heads(x: mx.array, count: int) -> mx.array:
    b, t, _ = x.shape
    return x.reshape(b, t, count, -1).transpose(0, 2, 1, 3)


def depth2_forward(
    module: NextNModule,
    trunk: Trunk,
    layer_in1: mx.array,
    hidden2: mx.array,
    tokens2: mx.array,
) -> mx.array:
    """layer_in1 [B, T, H]: the depth-1 decoder-layer inputs (fc outputs) of pairs 0..T-1;
    hidden2 [B, T-1, H]: the depth-1 post-norm outputs out1[0..T-2]; tokens2 [B, T-1]: the
    tokens fed at depth 2 (x[i+2]). Returns depth-2 draft-vocab logits [B, T-1, V']."""
    layer = module.layers[0]
    attn = layer.self_attn
    embedded = module.pre_fc_norm_embedding(mx.stop_gradient(trunk.embed(tokens2)))
    x2 = module.fc(mx.concatenate([embedded, module.pre_fc_norm_hidden(hidden2)], axis=-1))
    n1 = layer.input_layernorm(layer_in1)
    n2 = layer.input_layernorm(x2)
    k1 = attn.rope(_heads(attn.k_proj(n1), attn.n_kv_heads))
    v1 = _heads(attn.v_proj(n1), attn.n_kv_heads)
    q2 = attn.rope(_heads(attn.q_proj(n2), attn.n_heads), offset=1)
    k2 = attn.rope(_heads(attn.k_proj(n2), attn.n_kv_heads), offset=1)
    v2 = _heads(attn.v_proj(n2), attn.n_kv_heads)
    repeat = attn.n_heads // attn.n_kv_heads
    if repeat > 1:
        k1, v1, k2, v2 = (mx.repeat(a, repeat, axis=1) for a in (k1, v1, k2, v2))
    steps = q2.shape[2]
    scores = (q2 * attn.scale) @ k1.swapaxes(-1, -2)  # [B, h, T-1, T]
    allowed = mx.arange(k1.shape[2])[None, :] <= mx.arange(steps)[:, None]
    scores = mx.where(allowed, scores, mx.array(-1e9, scores.dtype))
    own = ((q2 * attn.scale) * k2).sum(-1, keepdims=True)  # [B, h, T-1, 1]
    probs = mx.softmax(mx.concatenate([scores, own], axis=-1), axis=-1)
    mixed = probs[..., :-1] @ v1 + probs[..., -1:] * v2
    b = x2.shape[0]
    h = x2 + attn.o_proj(mixed.transpose(0, 2, 1, 3).reshape(b, steps, -1))
    out = h + layer.mlp(layer.post_attention_layernorm(h))
    return module.lm_head(module.norm(out))
