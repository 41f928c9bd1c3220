"""What the engine needs from a loaded checkpoint: the contract between `mtplx.models` and
the engine. Loading code produces a `LoadedModel`; the engine and the drafters use only the
names here.

Alignment of MTP heads (the Qwen3-Next / DeepSeek-V3 convention): the target's hidden state
at position i (the one whose logits predict token x[i+1]) is paired with the embedding of
x[i+1]; the head's output at that position predicts x[i+2]. Depth > 1 recurses: the head's own
output hidden state at position i is paired with the embedding of the token it drafted for
x[i+2], at position i+1, and predicts x[i+3].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

from mtplx.blas_shim import INVARIANT_MAX_ROWS


class TargetModel(Protocol):
    """The target: one forward returning logits and the final hidden states."""

    vocab_size: int
    hidden_size: int

    def make_cache(self) -> list[Any]:
        """Fresh per-sequence cache objects (mlx-lm's: trimmable KV, non-trimmable state)."""
        ...

    def __call__(self, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """tokens: [B, T] int -> (logits [B, T, V], hidden [B, T, H]).

        ``hidden`` is what the MTP heads read: the final hidden state at each position, AFTER
        the trunk's final norm (the tensor the LM head multiplies; see mtplx.models.target)."""
        ...


class MTPHead(Protocol):
    """One multi-token-prediction module (one of ``num_nextn_predict_layers`` /
    ``mtp_num_hidden_layers`` blocks, or the recursive head of a Qwen3-Next checkpoint)."""

    @property
    def module(self) -> nn.Module:
        """The head's weights: loading settles their dtypes and quantization."""
        ...

    def make_cache(self) -> list[Any]:
        """Fresh per-sequence cache objects for the head's own attention layer(s)."""
        ...

    def make_lazy_cache(self) -> list[Any] | None:
        """A per-sequence cache that takes commits whose count is still computing
        (``mtplx.lazy_cache``), or None when the head's layers cannot read one: its drafter
        then commits eagerly."""
        ...

    def __call__(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any]
    ) -> tuple[mx.array, mx.array]:
        """hidden: [B, T, H] (target's or the head's own previous output), next_tokens: [B, T]
        (the token each hidden state predicted) -> (logits [B, T, V'], hidden [B, T, H]).

        V' is the draft vocabulary: the full V, or a reduced one mapped by
        ``LoadedModel.draft_vocab`` (draft id j -> target token id draft_vocab[j])."""
        ...

    def forward_rows(
        self,
        hidden: list[mx.array],
        next_tokens: list[mx.array],
        caches: list[list[Any]],
        at: list[mx.array] | None = None,
    ) -> list[tuple[mx.array, mx.array]]:
        """Many sequences' head steps at once: row i feeds hidden[i] [1, T_i, H] and
        next_tokens[i] [1, T_i] over its own cache caches[i] -> per row (logits
        [1, T_i, V'], hidden [1, T_i, H]), bitwise what ``self(hidden[i], next_tokens[i],
        caches[i])`` returns (a head that cannot pack rows runs them one by one).

        ``at``: per row a [] int32 (lazy) position among its T_i whose logits alone are
        wanted; row i's logits are then [1, 1, V'], the bits of that position's in the
        logits of all (a head may project that position alone: ``logits_at`` otherwise)."""
        ...


@dataclass
class LoadedModel:
    """A checkpoint ready for the engine."""

    path: Path
    model_type: str
    target: TargetModel
    tokenizer: Any  # mlx_lm TokenizerWrapper: encode, decode, detokenizer, chat template
    config: dict[str, Any]
    context_length: int
    mtp_heads: list[MTPHead] = field(default_factory=list)
    # Target token id of each draft-vocabulary entry when the heads draft over a reduced
    # vocabulary: int32 [V'], or None when V' == V.
    draft_vocab: mx.array | None = None
    eos_token_ids: set[int] = field(default_factory=set)
    # The products' weight formats (mtplx.models.quantized.describe_weights), e.g.
    # "affine q4/g32 (210), affine q8/g32 (1)" or "float32".
    weights: str = "float32"


def forward_each(
    head: MTPHead,
    hidden: list[mx.array],
    next_tokens: list[mx.array],
    caches: list[list[Any]],
) -> list[tuple[mx.array, mx.array]]:
    """``MTPHead.forward_rows`` for a head that cannot pack rows: one call per row."""
    return [head(h, t, c) for h, t, c in zip(hidden, next_tokens, caches, strict=True)]


def logits_at(
    outputs: list[tuple[mx.array, mx.array]], at: list[mx.array] | None
) -> list[tuple[mx.array, mx.array]]:
    """Each row's (logits [1, T_i, V'], hidden) -> (its logits at ``at[i]`` [1, 1, V'],
    hidden): ``MTPHead.forward_rows``'s ``at`` for a head that projects every position."""
    if at is None:
        return outputs
    return [
        (position(logits, row_at), hidden)
        for (logits, hidden), row_at in zip(outputs, at, strict=True)
    ]


def position(x: mx.array, at: mx.array) -> mx.array:
    """x [1, T, ...] at position ``at`` ([] int32, lazy) -> [1, 1, ...]: one dynamic slice
    (one graph node, where ``mx.take`` along axis 1 is four)."""
    return mx.slice(x, at, axes=(1,), slice_size=(1, 1, *x.shape[2:]))


def positions(x: mx.array, rows: mx.array) -> mx.array:
    """x [1, N, ...] at ``rows`` (lazy): [R] int32 -> [1, R, ...]; [] int32 -> [1, 1, ...]
    (``position``)."""
    return position(x, rows) if rows.ndim == 0 else mx.take(x, rows, axis=1)


# Rows of a head step: each row's hidden states [1, T_i, H], tokens [1, T_i] and cache.
RowPack = tuple[list[mx.array], list[mx.array], list[list[Any]]]
# A packed head step: the rows' (logits [1, T_i, V'], hidden [1, T_i, H]), as ``__call__``.
PackedForward = Callable[
    [list[mx.array], list[mx.array], list[list[Any]]], list[tuple[mx.array, mx.array]]
]


def pack_rows(
    hidden: list[mx.array], next_tokens: list[mx.array], caches: list[list[Any]]
) -> list[RowPack]:
    """The rows in order, in packs of at most INVARIANT_MAX_ROWS tokens: the products are
    batch-invariant up to that many rows. A row longer than that (a long prompt's pairs)
    goes alone, as it would without the others."""
    packs: list[RowPack] = []
    used = INVARIANT_MAX_ROWS  # tokens in the last pack: none open yet
    for row_hidden, row_tokens, row_cache in zip(hidden, next_tokens, caches, strict=True):
        size = int(row_tokens.shape[1])
        if used + size > INVARIANT_MAX_ROWS:
            packs.append(([], [], []))
            used = 0
        packs[-1][0].append(row_hidden)
        packs[-1][1].append(row_tokens)
        packs[-1][2].append(row_cache)
        used += size
    return packs


def forward_packed(
    head: MTPHead,
    packed: PackedForward,
    hidden: list[mx.array],
    next_tokens: list[mx.array],
    caches: list[list[Any]],
) -> list[tuple[mx.array, mx.array]]:
    """``MTPHead.forward_rows`` for a head whose ``packed`` step runs many rows' products
    over their tokens packed into one [1, N] sequence: the rows in packs (``pack_rows``), a
    row alone through ``head`` itself."""
    outputs: list[tuple[mx.array, mx.array]] = []
    for pack in pack_rows(hidden, next_tokens, caches):
        if len(pack[0]) == 1:
            outputs.append(head(pack[0][0], pack[1][0], pack[2][0]))
        else:
            outputs.extend(packed(*pack))
    return outputs
