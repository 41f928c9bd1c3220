"""The trainable MTP head: the loader's own ``NextNModule`` (so the trained weights load
exactly as the engine builds them), its initialisation from the frozen trunk, a full-sequence
training forward, and the float16 safetensors export with the Qwen3-Next/Qwen3.5 names.

Initialisation, and why. The head reads (h[i], x[i+1]) and must predict x[i+2]. h[i] is the
trunk's post-final-norm state, i.e. exactly what the (tied) LM head turns into the prediction
of x[i+1]; a head whose fc passed h[i] through would therefore start as a copy of the target's
*next*-token prediction -- the token the verifier already knows -- a bad starting point that
gradient descent has to climb out of. So fc starts as ``[I, a*I]`` with a small ``a``: the
residual stream starts as the (normed, rescaled) token embedding of x[i+1] plus a small share
of h[i], the same input distribution the trunk's first decoder layer sees. The decoder layer
is a copy of that first trunk layer, whose attention already mixes previous tokens' embeddings
-- i.e. it starts processing x[i+1] in the position whose successor it must predict. The final
norm is the trunk's, and the reduced LM head starts from the tied embedding rows of the draft
vocabulary (so logits are in the target's own output space from step 0).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mtplx.models.mtp_nextn import NextNModule
from mtplx.models.target import Trunk

HIDDEN_SHARE = 0.25  # initial weight of norm(h[i]) relative to the embedding in fc


def init_head(trunk: Trunk, draft_vocab: np.ndarray, *, source_layer: int = 0) -> NextNModule:
    """A fresh head over ``trunk`` with a reduced LM head over ``draft_vocab``, initialised as
    the module docstring explains (deterministic: no random draws)."""
    size = trunk.hidden_size
    module = NextNModule(trunk, 1, len(draft_vocab))
    layer = trunk.inner.layers[source_layer]
    module.layers[0].update(tree_map(lambda a: mx.array(a), layer.parameters()))
    embed = trunk.inner.embed_tokens.weight.astype(mx.float32)
    rms = float(mx.sqrt(mx.mean(embed * embed)).item())
    eye = mx.eye(size)
    module.pre_fc_norm_embedding.weight = mx.full((size,), rms)
    module.pre_fc_norm_hidden.weight = mx.ones((size,))
    module.fc.weight = mx.concatenate([eye, HIDDEN_SHARE * rms * eye], axis=1)
    module.norm.weight = mx.array(trunk.inner.norm.weight)
    if hasattr(trunk.owner, "lm_head") and "lm_head" in trunk.owner:
        rows = trunk.owner.lm_head.weight
    else:
        rows = trunk.inner.embed_tokens.weight
    module.lm_head.weight = mx.array(rows[mx.array(draft_vocab)]).astype(mx.float32)
    mx.eval(module.parameters())
    return module


def load_head(trunk: Trunk, path: Path) -> tuple[NextNModule, np.ndarray]:
    """(module, draft vocabulary) of a head written by ``save_head``, in float32, to train on."""
    weights = mx.load(str(path))
    draft_vocab = np.array(weights.pop("mtp.draft_vocab")).astype(np.int32)
    module = init_head(trunk, draft_vocab)
    names = {k for k, _ in tree_flatten(module.parameters())}
    found = {k.removeprefix("mtp."): v.astype(mx.float32) for k, v in weights.items()}
    if set(found) != names:
        raise ValueError(f"{path}: tensors {sorted(set(found) ^ names)} do not match the head")
    module.update(tree_unflatten(list(found.items())))
    mx.eval(module.parameters())
    return module, draft_vocab


def head_forward(
    module: NextNModule, trunk: Trunk, hidden: mx.array, next_tokens: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """Teacher-forced pass over whole sequences: hidden [B, T, H] (h[0..T-1]) and next_tokens
    [B, T] (x[1..T]) -> (draft-vocab logits [B, T, V'], post-norm output [B, T, H], decoder
    layer input [B, T, H]); the causal mask makes position i see the pairs 0..i, as the
    drafter's KV cache does."""
    embedded = module.pre_fc_norm_embedding(mx.stop_gradient(trunk.embed(next_tokens)))
    x = module.fc(mx.concatenate([embedded, module.pre_fc_norm_hidden(hidden)], axis=-1))
    y = module.layers[0](x, "causal" if x.shape[1] > 1 else None, None)
    out = module.norm(y)
    return module.lm_head(out), out, x


def head_weights(module: NextNModule, draft_vocab: np.ndarray) -> dict[str, mx.array]:
    """The checkpoint tensors: ``mtp.<name>`` in float16, plus ``mtp.draft_vocab`` (int32)."""
    weights = {f"mtp.{k}": v.astype(mx.float16) for k, v in tree_flatten(module.parameters())}
    weights["mtp.draft_vocab"] = mx.array(np.asarray(draft_vocab, np.int32))
    return weights


def save_head(module: NextNModule, draft_vocab: np.ndarray, path: Path) -> Path:
    """Write the head as safetensors (atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), head_weights(module, draft_vocab), metadata={"format": "mlx"})
    tmp.replace(path)
    return path


def trainable(module: nn.Module) -> int:
    """Number of parameters."""
    return sum(v.size for _, v in tree_flatten(module.parameters()))
