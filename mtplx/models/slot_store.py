"""The KV side of ``SlotTarget``: its rows' slots, the stores that hold their keys, values
and hidden states (``mtplx.models.kv_store``), and blocks of a row's positions saved for the
prefix cache.

Every row is a slot of the shared store while it fits in ``shared_capacity`` positions;
a longer row moves to a store of its own (its KV so far copied over), or starts there when
its prompt is known to outgrow the shared store (``new_row(expected_length)``), so memory
follows what runs, not the longest row times the slot count. Rejected draft tokens are dropped by
shortening a row (``trim``, ``rollback``) or lazily (``trim_lazily``: the count is an array
still computing, applied by ``settle``).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mtplx.arrays import scalar_int
from mtplx.blas_shim import INVARIANT_MAX_ROWS
from mtplx.models.kv_store import KV_STEP, SLOT_STEP, KVStore
from mtplx.models.quantized import activation_dtype
from mtplx.models.slot_layout import SlotRow, token_shifts

__all__ = ["IDLE_CAPACITY", "SlotBlockState", "SlotStores"]

# An idle shared store above this many positions per slot is freed (``SlotTarget.release``).
IDLE_CAPACITY = 2 * KV_STEP


@dataclass
class SlotBlockState:
    """A block of one row's positions, saved for the prefix cache: the KV of every layer and
    the post-norm hidden states (what the drafters read)."""

    keys: mx.array  # [layers, kv_heads, B, d]
    values: mx.array  # [layers, kv_heads, B, d + 1]
    hidden: mx.array  # [B, H]
    resumable = True  # a row can continue after any block

    @property
    def nbytes(self) -> int:
        """Bytes of the three arrays."""
        return self.keys.nbytes + self.values.nbytes + self.hidden.nbytes


class SlotStores:
    """Rows, their stores and their saved blocks: the part of ``SlotTarget`` that owns KV
    memory (its attributes are set by ``SlotTarget.__init__``)."""

    trunk: Any
    hidden_size: int
    keep_hidden: bool  # store every position's hidden state (prefix cache)
    max_rows: int
    shared_capacity: int  # rows longer than this keep their KV in a store of their own
    _free: list[int]  # free slots
    _live: dict[int, SlotRow]  # slot -> its row
    _shared: KVStore  # every slot, up to shared_capacity long
    _private: dict[int, KVStore]  # slot -> the store of a row past it
    _prefill_tokens: int  # the products' row limit for one row's prompt chunk

    @property
    def max_prefill_tokens(self) -> int:
        """The most prompt tokens a row feeds in one forward (the engine's largest piece):
        the products' row limit, and at most half the shared store (a shared row's chunk is
        the store's padding, ``_place``), never below INVARIANT_MAX_ROWS."""
        return min(self._prefill_tokens, max(INVARIANT_MAX_ROWS, self.shared_capacity // 2))

    def _new_store(self, num_slots: int) -> KVStore:
        attention = self.trunk.inner.layers[0].self_attn
        return KVStore(
            num_slots=num_slots,
            num_layers=len(self.trunk.inner.layers),
            kv_heads=attention.n_kv_heads,
            head_dim=attention.head_dim,
            hidden_size=self.hidden_size,
            dtype=activation_dtype(self.trunk.inner),
            keep_hidden=self.keep_hidden,
        )

    @property
    def kv_nbytes(self) -> int:
        """Bytes of KV (and hidden states) held: the shared store and the long rows'."""
        return self._shared.nbytes + sum(store.nbytes for store in self._private.values())

    # -- rows ---------------------------------------------------------------------------

    def new_row(self, expected_length: int = 0) -> SlotRow:
        """The lowest free slot (so the slots in use stay dense at the front); a row expected
        to outgrow the shared store starts in a store of its own at its first forward."""
        if not self._free:
            raise RuntimeError(f"all {self.max_rows} slots are in use")
        self._free.sort()
        row = SlotRow(self._free.pop(0), expected=max(0, expected_length))
        self._live[row.slot] = row
        return row

    def release(self, row: SlotRow) -> None:
        """Return the row's slot; its stale KV is never read (reads stop at a row's length).
        A long row's own store is freed with it."""
        row.unsettled = []
        freed = row.private and self._private.pop(row.slot, None) is not None
        row.private = False
        if row.slot >= 0:
            del self._live[row.slot]
            self._free.append(row.slot)
            row.slot = -1
        idle_slots = self._initial_slots()
        if not self._live and (
            self._shared.capacity > IDLE_CAPACITY or self._shared.num_slots > idle_slots
        ):
            # The shared store grows every slot to the longest row it holds, and its slots
            # to the highest one in use, and never shrinks while rows run: once none is
            # left, give that memory back (the next forward allocates afresh; saved prefix
            # blocks are copies).
            self._shared.free(idle_slots)
            freed = True
        if freed:
            _return_freed_memory()

    def trim(self, row: SlotRow, num_tokens: int) -> None:
        """Forget the last positions; their KV entries are overwritten by later writes."""
        row.length -= min(num_tokens, row.length)

    trims_lazily = True

    def trim_lazily(self, row: SlotRow, num_tokens: mx.array) -> None:
        """``trim`` by a count still computing ([] int32): later forwards of the row write
        and attend as if it were trimmed; ``settle`` applies it to ``row.length``."""
        # The count itself where it is int32 already: ``settle`` then reads the array the
        # cycle's evaluation computed, not a conversion computed later.
        row.unsettled.append(
            num_tokens if num_tokens.dtype == mx.int32 else num_tokens.astype(mx.int32)
        )

    def settle(self, row: SlotRow) -> int:
        """Read the row's oldest lazy trim (its verdict must be computed or computing) and
        apply it; returns the count."""
        num_tokens = scalar_int(row.unsettled.pop(0))
        row.length -= num_tokens
        return num_tokens

    def checkpoint(self, row: SlotRow) -> int:
        """The row's length."""
        return row.length

    def rollback(self, row: SlotRow, point: int) -> None:
        """Back to a length."""
        row.length = point

    # -- prefix cache -------------------------------------------------------------------

    def unevaluated(self) -> list[mx.array]:
        """State a forward updated that no output depends on (the hidden-state store):
        evaluate it with the forward's outputs, or its updates pile up unevaluated."""
        stores = [self._shared, *self._private.values()]
        return [store.hidden for store in stores if store.hidden is not None]

    def block_nbytes(self, num_positions: int) -> int:
        """Bytes of a ``save_block`` state of ``num_positions`` positions."""
        attention = self.trunk.inner.layers[0].self_attn
        per_position = (
            len(self.trunk.inner.layers)
            * attention.n_kv_heads
            * (
                2 * attention.head_dim + 1  # keys, values and their constant-1 feature
            )
            + self.hidden_size
        )
        return num_positions * per_position * activation_dtype(self.trunk.inner).size

    saves_blocks = True
    resumes_anywhere = True  # the slot store: bitwise the same states however fed
    calibration_key: str | None = None

    def save_block(
        self, row: SlotRow, start: int, end: int, hidden: mx.array | None = None
    ) -> SlotBlockState:
        """A copy of the row's states at positions [start, end) (all computed; the slots
        keep hidden states themselves, ``hidden`` is not needed)."""
        store, index = self._store_of(row)
        if not 0 <= start < end <= row.length or store.hidden is None:
            raise ValueError(f"positions [{start}, {end}) are not in the row")
        state = SlotBlockState(
            mx.stack([layer.keys[index, :, start:end] for layer in store.layers]),
            mx.stack([layer.values[index, :, start:end] for layer in store.layers]),
            mx.contiguous(store.hidden[index, start:end]),  # a copy, not a view of the store
        )
        mx.eval(state.keys, state.values, state.hidden)
        return state

    def load_blocks(self, row: SlotRow, states: Sequence[SlotBlockState]) -> mx.array:
        """Append saved blocks to the row, as if their tokens had been fed; returns their
        hidden states [sum B, H]."""
        keys = mx.concatenate([state.keys for state in states], axis=2)
        values = mx.concatenate([state.values for state in states], axis=2)
        hidden = mx.concatenate([state.hidden for state in states])
        start, end = row.length, row.length + hidden.shape[0]
        self._place(row, end)
        if not row.private:
            self._hold_slots([row.slot])
        store, index = self._store_of(row)
        store.ensure(end)
        for number, layer in enumerate(store.layers):
            layer.keys[index, :, start:end] = keys[number]
            layer.values[index, :, start:end] = values[number]
        assert store.hidden is not None
        store.hidden[index, start:end] = hidden
        row.length = end
        return hidden

    def _place(self, row: SlotRow, needed: int) -> None:
        """Make room for the row's first ``needed`` positions: a row that outgrows
        ``shared_capacity`` moves to a store of its own (its KV so far copied over), which then
        grows with it by a quarter of its length at a time."""
        # The shared store holds its rows' ends plus a forward's padding (at most
        # max_prefill_tokens): a row goes once that could take it past shared_capacity, or
        # before its first forward when its prompt will (copying a long prompt's KV out of
        # the shared store and regrowing its own store cost a prefill page faults and copies).
        needed_soon = max(needed, row.expected)
        if not row.private and needed_soon + self.max_prefill_tokens > self.shared_capacity:
            row.private = True
        if not row.private:
            # A pipeline stage mirrors rows: a slot it held a long row in now holds a short one.
            if self._private.pop(row.slot, None) is not None:
                _return_freed_memory()
            return
        store = self._private.get(row.slot)
        if store is None:
            store = self._private[row.slot] = self._new_store(1)
            store.ensure(needed_soon)
            if row.slot < self._shared.num_slots:
                held = min(row.length, self._shared.capacity)
                store.copy_slot(self._shared, row.slot, 0, held)
        store.ensure(needed, min_growth=store.capacity // 4)

    def _initial_slots(self) -> int:
        """The shared store's slots before any grows it (``SLOT_STEP``, at most max_rows)."""
        return min(self.max_rows, SLOT_STEP)

    def _hold_slots(self, slots: Sequence[int]) -> None:
        """Grow the shared store's slots (in SLOT_STEPs, at most max_rows) to hold these."""
        if slots:
            wanted = -(-(max(slots) + 1) // SLOT_STEP) * SLOT_STEP
            self._shared.ensure_slots(min(self.max_rows, wanted))

    def _store_of(self, row: SlotRow) -> tuple[KVStore, int]:
        """The store holding the row's KV and the row's slot index in it."""
        if row.private:
            return self._private[row.slot], 0
        return self._shared, row.slot

    def _ensure_capacity(self, positions: int) -> None:
        """Grow the shared store (all slots) to hold ``positions`` per slot."""
        self._shared.ensure(positions)

    def _keep_hidden(self, rows: list[SlotRow], counts: list[int], hidden: mx.array) -> None:
        """Store each fed position's hidden state (hidden: [N, H] packed) in its row's store."""
        if not self.keep_hidden:
            return
        shifts = token_shifts(rows, counts)
        by_store: dict[int, tuple[KVStore, list[int], list[int]]] = {}
        packed = 0
        for row, count in zip(rows, counts, strict=True):
            store, index = self._store_of(row)
            _, positions, picked = by_store.setdefault(id(store), (store, [], []))
            positions.extend(index * store.capacity + row.length + t for t in range(count))
            picked.extend(range(packed, packed + count))
            packed += count
        for store, positions, picked in by_store.values():
            assert store.hidden is not None
            at = mx.array(positions, mx.int32)
            fed = mx.array(picked, mx.int32)
            if shifts is not None:
                at = at - shifts[fed]
            flat = store.hidden.reshape(store.num_slots * store.capacity, -1)
            flat[at] = hidden[fed]
            store.hidden = flat.reshape(store.hidden.shape)


def _return_freed_memory() -> None:
    """Hand freed buffers back to the system: MLX keeps them for reuse, and glibc keeps
    freed heap pages (buffers of tens of MB come from its heap once it has freed a few)."""
    mx.clear_cache()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # musl and others: no malloc_trim
            ctypes.CDLL("libc.so.6").malloc_trim(0)
