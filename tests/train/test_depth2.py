"""The depth-2 training forward equals what the drafter computes with its KV cache."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from mtplx.models import load
from mtplx.models.mtp_nextn import NextNHead
from mtplx.train.depth2 import depth2_forward
from mtplx.train.head import head_forward, init_head


def test_depth2_matches_cached_recursion(llama_no_mtp_checkpoint: Path) -> None:
    model = load(llama_no_mtp_checkpoint)
    trunk = model.target.trunk
    module = init_head(trunk, np.arange(40, dtype=np.int32))
    rng = np.random.default_rng(0)
    mx.random.seed(0)
    # perturb every weight so the check does not hinge on the init's structure
    module.update(tree_map(lambda a: a + 0.05 * mx.random.normal(a.shape), module.parameters()))
    tokens = mx.array(rng.integers(0, trunk.vocab_size, (1, 9)), mx.int32)
    _, hidden = model.target(tokens, model.target.make_cache())
    h, nxt = hidden[:, :-1], tokens[:, 1:]  # pairs (h[j], x[j+1]), j = 0..7
    _, out1, layer_in = head_forward(module, trunk, h, nxt)
    batched = depth2_forward(module, trunk, layer_in, out1[:, :-1], nxt[:, 1:])
    head = NextNHead(module, 0, trunk)
    for i in range(7):
        cache = head.make_cache()
        _, out = head(h[:, : i + 1], nxt[:, : i + 1], cache)
        logits2, _ = head(out[:, -1:], nxt[:, i + 1 : i + 2], cache)
        np.testing.assert_allclose(
            np.array(logits2[0, 0]), np.array(batched[0, i]), rtol=1e-4, atol=1e-4
        )
