"""The interface every batched target offers the engine: rows, their outputs, one forward
over many rows (``mtplx.models.slot_target.SlotTarget``, ``mtplx.models.per_row.PerRowTarget``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import mlx.core as mx

from mtplx.prefix_cache import BlockState


class Row(Protocol):
    """One sequence's target state inside a batched target."""

    length: int  # committed positions in the target cache


# A target's own row type: its methods take the rows its ``new_row`` made and no other kind,
# so the parameter is invariant (callers that hold rows opaquely use ``BatchedTarget[Any]``).
RowT = TypeVar("RowT", bound=Row)


@dataclass
class RowOutput:
    """One row's share of a batched forward."""

    logits: mx.array | None  # [T_i, V], [1, V] (the last position) or None, as asked
    hidden: mx.array  # [T_i, H] post-norm hidden states

    def asked_logits(self) -> mx.array:
        """The logits of a forward that asked for them (verify and plain rows always do)."""
        if self.logits is None:
            raise ValueError("this row's forward did not ask for logits")
        return self.logits


class BatchedTarget(Protocol[RowT]):
    """A target that runs many rows in one forward, over rows of its own type ``RowT``."""

    vocab_size: int
    hidden_size: int
    recurrent: bool  # rows hold state that ``trim`` cannot drop (use checkpoint/rollback)

    def new_row(self, expected_length: int = 0) -> RowT:
        """An empty row (no committed positions). ``expected_length``: the positions it is
        expected to reach (its prompt's; 0 when unknown), a hint for where to keep its state
        from the start, never a limit."""
        ...

    def release(self, row: RowT) -> None:
        """Free a row's storage; the row must not be used again."""
        ...

    @property
    def kv_nbytes(self) -> int:
        """Bytes of KV (and other per-row state) the target holds for its rows now."""
        ...

    # Tokens a forward may pack and keep every row batch-invariant (0: the target packs no
    # rows, each runs a forward of its own, so no limit).
    max_packed_rows: int

    @property
    def max_prefill_tokens(self) -> int:
        """The most tokens one prefilling row may feed in a forward shared with other rows
        (read-only: a target may derive it from its state; unused where the target does
        not ``resumes_anywhere``: its prompts go in the engine's fixed chunks)."""
        ...

    def forward(
        self, rows: list[RowT], tokens: list[mx.array], logits: Sequence[str] | str = "all"
    ) -> list[RowOutput]:
        """tokens[i]: [T_i] int32 (may be lazy) appended to rows[i] -> one output per row.
        Every row's length grows by T_i. ``logits`` (per row, or one for all): "all"
        positions, the "last" one, or "none" (a prefill chunk that does not end its
        prompt)."""
        ...

    def trim(self, row: RowT, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` positions of ``row`` (KV rows only)."""
        ...

    def checkpoint(self, row: RowT) -> Any:
        """A point ``rollback`` returns the row to."""
        ...

    def rollback(self, row: RowT, point: Any) -> None:
        """Return ``row`` to ``point``."""
        ...

    def unevaluated(self) -> list[mx.array]:
        """State the last forward updated that no output depends on: evaluate it with the
        outputs."""
        ...

    # Lazy trims: drop rejected draft positions by a count still computing, so a drafting
    # cycle can run one step ahead (False: only ``trim``; the two methods are never called).
    trims_lazily: bool

    def trim_lazily(self, row: RowT, num_tokens: mx.array) -> None:
        """``trim`` by a count still computing ([] int32); ``settle`` applies it."""
        ...

    def settle(self, row: RowT) -> int:
        """Read the row's oldest lazy trim and apply it; returns the count."""
        ...

    # Prefix-cache blocks: copies of a row's states that another row can resume from
    # (False: the layer caches cannot be saved; the two methods are never called).
    saves_blocks: bool

    def save_block(
        self, row: RowT, start: int, end: int, hidden: mx.array | None = None
    ) -> BlockState | None:
        """A copy of the row's states at positions [start, end); ``hidden``: their hidden
        states when the target does not keep them. None: nothing saved."""
        ...

    def load_blocks(self, row: RowT, states: Sequence[Any]) -> mx.array:
        """Append saved blocks to the row; returns their hidden states [sum B, H]."""
        ...

    # Whether a row's states are bitwise the same however its tokens were split into
    # forwards (prompt chunks of any size, decode steps, verifies): then a block of a reply
    # resumes as exactly as one of a prompt, and a row may resume after any block (False:
    # only where its prompt chunks end, which the prompt alone fixes).
    resumes_anywhere: bool

    def block_nbytes(self, num_positions: int) -> int | None:
        """Bytes of a ``save_block`` state of ``num_positions`` positions, where known before
        one is saved (None: the prefix cache learns it from the first block)."""
        ...

    # What sets this target's step costs apart from a single process's (a pipeline's ranks
    # and links), for the calibration cache's key; None: nothing.
    calibration_key: str | None


def logits_per_row(logits: Sequence[str] | str, rows: Sequence[object]) -> list[str]:
    """The ``logits`` argument of ``forward`` as one choice per row."""
    wanted = [logits] * len(rows) if isinstance(logits, str) else list(logits)
    if len(wanted) != len(rows) or any(w not in ("all", "last", "none") for w in wanted):
        raise ValueError(f"logits must be 'all', 'last' or 'none' per row, got {logits!r}")
    return wanted
