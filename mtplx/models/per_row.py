"""``PerRowTarget``: any target model batched as one forward of its own code per row (hybrid
recurrent, MLA, ... families), queued together and evaluated at once. Exact, not faster.
Prompt blocks of its rows can be saved and loaded for the prefix cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mtplx import cache as cache_ops
from mtplx.models.base import TargetModel
from mtplx.models.rows import RowOutput, logits_per_row

# The layer caches whose prompt states ``PerRowTarget`` saves for the prefix cache.
_BLOCK_CACHES = ("KVCache", "ArraysCache")


@dataclass(eq=False)
class CacheRow:
    """A row of ``PerRowTarget``: the model's own per-sequence cache objects."""

    cache: list[Any]
    length: int = 0


@dataclass
class CacheRowBlockState:
    """A block of a ``PerRowTarget`` row's prompt, saved for the prefix cache: per layer the
    block's keys and values (attention layers), and the recurrent layers' state at the
    block's end when the row was there (None: the row cannot resume after this block)."""

    kv: list[tuple[mx.array, mx.array] | None]  # [1, kv_heads, B, d] each
    recurrent: list[Any] | None  # per layer: a state snapshot (None for attention layers)
    hidden: mx.array  # [B, H]

    @property
    def resumable(self) -> bool:
        """Whether a row can continue right after this block."""
        return self.recurrent is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the block's arrays (recurrent snapshots included)."""
        total = self.hidden.nbytes + sum(k.nbytes + v.nbytes for k, v in filter(None, self.kv))
        for state in self.recurrent or []:
            if state is not None:
                total += sum(a.nbytes for a in _arrays(state))
        return total


def _arrays(value: Any) -> list[mx.array]:
    """The MLX arrays inside a cache state snapshot (nested tuples, lists, dicts)."""
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [array for item in value for array in _arrays(item)]
    return []


class PerRowTarget:
    """Any TargetModel, one forward per row (all queued before one evaluation)."""

    # Each row runs its own forward: no rows are packed, so no limit on a forward's tokens
    # (prompts go in the engine's fixed chunks beside decoding rows: not resumes_anywhere).
    max_packed_rows = 0
    max_prefill_tokens = 0
    # Rows are rolled back after their verdicts are read: cycles are not run one step ahead.
    trims_lazily = False
    # A layer's states depend on how the tokens were split into forwards: blocks resume only
    # where the prompt's fixed chunks end.
    resumes_anywhere = False
    calibration_key: str | None = None

    def __init__(self, target: TargetModel) -> None:
        self.target = target
        self.vocab_size = target.vocab_size
        self.hidden_size = target.hidden_size
        self._live: list[CacheRow] = []  # rows not released
        cache = target.make_cache()
        self.recurrent = not cache_ops.is_trimmable(cache)
        # Prompt blocks can be saved and loaded when every layer is mlx-lm's plain KV cache
        # or a recurrent ArraysCache (whose state is rebound, never written into).
        self.saves_blocks = all(type(layer).__name__ in _BLOCK_CACHES for layer in cache)

    def new_row(self, expected_length: int = 0) -> CacheRow:
        """A row with fresh cache objects (caches grow as they go: no use for the hint)."""
        row = CacheRow(self.target.make_cache())
        self._live.append(row)
        return row

    def release(self, row: CacheRow) -> None:
        """Drop the row's cache."""
        row.cache = []
        if row in self._live:
            self._live.remove(row)

    @property
    def kv_nbytes(self) -> int:
        """Bytes the live rows' caches hold."""
        return sum(layer.nbytes for row in self._live for layer in row.cache)

    def forward(
        self, rows: list[CacheRow], tokens: list[mx.array], logits: Sequence[str] | str = "all"
    ) -> list[RowOutput]:
        """One forward of the model's own code per row."""
        outputs = []
        for row, row_tokens, wanted in zip(rows, tokens, logits_per_row(logits, rows), strict=True):
            row_logits, hidden = self.target(row_tokens[None], row.cache)  # [1, T, V], [1, T, H]
            row.length += row_tokens.shape[0]
            selected = {"all": row_logits[0], "last": row_logits[0, -1:], "none": None}[wanted]
            outputs.append(RowOutput(selected, hidden[0]))
        return outputs

    def trim(self, row: CacheRow, num_tokens: int) -> None:
        """Trim every layer cache of the row."""
        cache_ops.trim(row.cache, num_tokens)
        row.length -= num_tokens

    def checkpoint(self, row: CacheRow) -> tuple[cache_ops.CacheCheckpoint, int]:
        """Snapshot the row's cache (recurrent state by reference)."""
        return cache_ops.checkpoint(row.cache), row.length

    def rollback(self, row: CacheRow, point: tuple[cache_ops.CacheCheckpoint, int]) -> None:
        """Restore the row's cache to ``point``."""
        cache_ops.rollback(row.cache, point[0])
        row.length = point[1]

    def unevaluated(self) -> list[mx.array]:
        """Nothing: every cache update feeds the outputs."""
        return []

    def trim_lazily(self, row: CacheRow, num_tokens: mx.array) -> None:
        raise NotImplementedError("per-row targets trim only by read counts (trims_lazily)")

    def settle(self, row: CacheRow) -> int:
        raise NotImplementedError("per-row targets trim only by read counts (trims_lazily)")

    def block_nbytes(self, num_positions: int) -> None:
        """Not known before a block is saved (recurrent layers hold state of their own)."""
        return None

    def save_block(
        self, row: CacheRow, start: int, end: int, hidden: mx.array | None = None
    ) -> CacheRowBlockState | None:
        """A copy of the row's prompt states at positions [start, end); ``hidden``: their
        hidden states [end - start, H] (None: not at hand, nothing is saved). The recurrent
        state is the row's own now, so it is kept only when the block ends the row."""
        if hidden is None or not self.saves_blocks:
            return None
        if not 0 <= start < end <= row.length:
            raise ValueError(f"positions [{start}, {end}) are not in the row")
        kv: list[tuple[mx.array, mx.array] | None] = []
        recurrent: list[Any] | None = [] if end == row.length else None
        for layer in row.cache:
            if layer.is_trimmable():
                kv.append(
                    (
                        mx.contiguous(layer.keys[..., start:end, :]),
                        mx.contiguous(layer.values[..., start:end, :]),
                    )
                )
                if recurrent is not None:
                    recurrent.append(None)
            else:
                kv.append(None)
                if recurrent is not None:
                    recurrent.append(cache_ops.snapshot(layer))
        state = CacheRowBlockState(kv, recurrent, mx.contiguous(hidden))
        mx.eval(state.hidden, [pair for pair in kv if pair is not None], _arrays(recurrent))
        return state

    def load_blocks(self, row: CacheRow, states: Sequence[CacheRowBlockState]) -> mx.array:
        """Append saved blocks to the row (the last one must be resumable); returns their
        hidden states [sum B, H]."""
        last = states[-1].recurrent
        if last is None:
            raise ValueError("the row cannot resume after the last block")
        for index, layer in enumerate(row.cache):
            if layer.is_trimmable():
                keys = mx.concatenate([s.kv[index][0] for s in states], axis=2)  # type: ignore[index]
                values = mx.concatenate([s.kv[index][1] for s in states], axis=2)  # type: ignore[index]
                layer.update_and_fetch(keys, values)
            else:
                cache_ops.restore(layer, last[index])
        hidden = mx.concatenate([state.hidden for state in states])
        row.length += hidden.shape[0]
        return hidden
