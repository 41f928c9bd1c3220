"""Batched target forwards: the tokens of many sequences, each at its own length, in one forward.

A step of the engine runs one target forward over every running row: row i feeds ``T_i``
tokens (1 for plain decoding, 1 + k when it verifies k draft tokens) after its own ``L_i``
committed ones. Two implementations of the one interface (``BatchedTarget``):

- ``SlotTarget`` (``mtplx.models.slot_target``; llama-like trunks, the default model): the
  rows' tokens are packed into one ``[1, N]`` sequence (N = sum of T_i) for every matmul, so
  each weight is read once per step for all rows; attention runs per row over a KV store
  with one slot per row: in the fused C kernel (``mtplx.attention``: per packed token and
  head, over that token's own keys) on the CPU, else in MLX ops in a padded
  ``[R, heads, T_max, L_max]`` layout. A row's logits never depend on the other rows,
  bitwise: the matmuls' batch-invariant kernels sum every output element in a fixed order
  whatever the row count, the fused attention computes a token from its own inputs alone,
  and the MLX-op attention is written so that a row's padding (shorter history, fewer
  tokens than T_max) only appends exact zeros to its sums, which the kernel ignores
  (``mtplx/blas_invariant.c``). A row alone and the same row among 15 others give the same
  bits, and a prompt fed in one forward gives the bits of token-by-token decode steps.
- ``PerRowTarget`` (``mtplx.models.per_row``; every other family: recurrent layers, MLA,
  ...): one forward of the model's own code per row, queued together and evaluated at
  once. Exact, not faster.

Rows are created with ``new_row`` and released with ``release``; rejected draft tokens are
dropped with ``trim`` (attention KV) or ``checkpoint`` / ``rollback`` (recurrent state).
``SlotTarget`` also trims lazily (``trim_lazily``: the count is an array still computing), so
the next forward of a drafting row can be built before its verdict is read; ``settle`` reads
the count once it is computed.
"""

from __future__ import annotations

from typing import Any

from mtplx.models.base import TargetModel
from mtplx.models.per_row import PerRowTarget
from mtplx.models.rows import BatchedTarget, Row, RowOutput
from mtplx.models.slot_layout import SlotRow
from mtplx.models.slot_target import SlotTarget

# The interface and its two implementations, beside the factory: what the engine and
# scripts import from here (each is defined in its own module).
__all__ = [
    "BatchedTarget",
    "PerRowTarget",
    "Row",
    "RowOutput",
    "SlotRow",
    "SlotTarget",
    "batched_target",
]


def batched_target(
    target: TargetModel, max_rows: int, keep_hidden: bool = False
) -> BatchedTarget[Any]:
    """The fastest exact batched form of ``target``: slots for mlx-lm's llama trunks, one
    forward per row otherwise. ``keep_hidden``: slots keep every position's hidden state,
    so that blocks of them can be saved for the prefix cache."""
    trunk = getattr(target, "trunk", None)
    if trunk is not None and trunk.arch == "llama" and type(target).__name__ == "MLXTarget":
        return SlotTarget(target, max_rows, keep_hidden)
    return PerRowTarget(target)
