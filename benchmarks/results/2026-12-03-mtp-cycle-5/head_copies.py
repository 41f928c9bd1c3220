"""KV store copies of the MTP head's cache when two head steps write it in one evaluation
(a feed of 2 pairs, then a deeper draft step of 1), the layer as one node or five, with the
cache's buffers among the evaluated outputs or not; the tiny test checkpoint (q4 trunk,
8-bit head). Run with ``PYTHONPATH=<tree>`` (``tests.fixtures`` builds the checkpoint)."""

from __future__ import annotations

import pathlib
import tempfile

# ruff: noqa: I001  (mtplx routes BLAS before MLX loads: it is imported first)
import mtplx  # noqa: F401
import mlx.core as mx

from mtplx import fused_layer
from mtplx.lazy_cache import LazyKVCache
from mtplx.models import load
from mtplx.models.fused_head import fuse_head
from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.variants import quantize_checkpoint


def main() -> None:
    directory = pathlib.Path(tempfile.mkdtemp())
    build_checkpoint("llama_mtp", directory, draft_vocab=None)
    quantize_checkpoint(directory, bits=4, group_size=64)
    model = load(directory)
    head = model.mtp_heads[0]
    fuse_head(head)
    size = model.target.trunk.hidden_size

    def hidden(n: int) -> mx.array:
        return mx.random.normal((1, n, size))

    for node in (True, False):
        head.fused = head.fused._replace(layer_node=node)
        cache = [LazyKVCache()]
        ((_, h),) = head.forward_rows([hidden(5)], [mx.array([[1, 2, 3, 4, 5]])], [cache])
        mx.eval(h, cache[0].keys, cache[0].values)
        c0 = fused_layer.store_copies()
        ((_, h),) = head.forward_rows([hidden(2)], [mx.array([[1, 2]])], [cache])
        ((_, h2),) = head.forward_rows([h[:, -1:]], [mx.array([[3]])], [cache])
        mx.eval(h2, cache[0].keys, cache[0].values)
        c1 = fused_layer.store_copies()
        ((_, h),) = head.forward_rows([hidden(2)], [mx.array([[1, 2]])], [cache])
        ((_, h2),) = head.forward_rows([h[:, -1:]], [mx.array([[3]])], [cache])
        mx.eval(h2)  # the caches not asked for
        c2 = fused_layer.store_copies()
        name = "layer node" if node else "five nodes"
        print(f"{name} two writes in one eval (caches asked): {c1 - c0} ; not asked: {c2 - c1}")


if __name__ == "__main__":
    main()
