"""The KV memory of ``SlotTarget``: stores of slots, each slot at the store's one capacity.

Attention reads a window of consecutive slots of a store as one padded array, which is what
makes a step's attention a few products for all rows. Every slot of a store has the same
capacity, so a store costs ``slots x capacity``: one long row in the shared store would make
every slot as long as it. Rows longer than ``SHARED_CAPACITY`` positions therefore keep their
KV in a store of their own (one slot, grown with the row), and the shared store stays at
most ``SHARED_CAPACITY`` long: memory follows what runs, not the longest row times the slot
count.

Layout per layer: keys [S, kv_heads, L_cap, d], values [S, kv_heads, L_cap, d + 1] (the
constant-1 feature of ``SlotTarget``'s MLX-op attention, which gets the softmax's normaliser
from the same product; the fused kernel normalises itself and skips it), heads before
positions (a window of slots read up to L is then, per (slot, head), a matrix whose rows are
whole, which MLX's matmul takes as it is; the fused kernel reads a token's keys from its
slot alone). Optionally each position's hidden state [S, L_cap, H] (the prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

__all__ = ["KV_STEP", "SHARED_CAPACITY", "SLOT_STEP", "KVStore", "LayerKV"]

# Capacity grows in steps of this many positions (mlx-lm's KVCache step).
KV_STEP = 256
# The longest the shared store grows; longer rows get stores of their own.
SHARED_CAPACITY = 4 * KV_STEP
# The shared store's slots grow in steps of this many, with the highest slot in use: a
# server that runs one conversation holds one step of slots, not its whole batch's.
SLOT_STEP = 4


@dataclass
class LayerKV:
    """One layer's keys [S, kv, L_cap, d] and values [S, kv, L_cap, d + 1]."""

    keys: mx.array
    values: mx.array


@dataclass
class KVStore:
    """``num_slots`` slots of KV (and hidden states when ``keep_hidden``) for every layer, all
    at ``capacity`` positions. Grown with ``ensure``; ``free`` drops the arrays."""

    num_slots: int
    num_layers: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    dtype: mx.Dtype
    keep_hidden: bool
    layers: list[LayerKV] = field(default_factory=list)
    hidden: mx.array | None = None  # [S, L_cap, H]
    capacity: int = 0

    def ensure(self, positions: int, min_growth: int = KV_STEP) -> None:
        """Grow every slot to hold ``positions`` (a multiple of KV_STEP, and by at least
        ``min_growth`` positions: a long row grows by a share of its length, so that its
        copies add up to a few times its size, not its size squared over KV_STEP)."""
        if positions <= self.capacity:
            return
        wanted = max(positions, self.capacity + min_growth)
        capacity = -(-wanted // KV_STEP) * KV_STEP
        grow = (self.num_slots, self.kv_heads, capacity - self.capacity)
        key_shape = (*grow, self.head_dim)
        value_shape = (*grow, self.head_dim + 1)
        hidden_zeros = mx.zeros((self.num_slots, grow[2], self.hidden_size), self.dtype)
        if not self.layers:
            # An array of its own per layer: blocks are loaded by writing into the stores in
            # place, which would write every layer's blocks into one shared array.
            self.layers = [
                LayerKV(mx.zeros(key_shape, self.dtype), mx.zeros(value_shape, self.dtype))
                for _ in range(self.num_layers)
            ]
            self.hidden = hidden_zeros if self.keep_hidden else None
        else:
            key_zeros = mx.zeros(key_shape, self.dtype)
            value_zeros = mx.zeros(value_shape, self.dtype)
            for layer in self.layers:
                layer.keys = mx.concatenate([layer.keys, key_zeros], axis=2)
                layer.values = mx.concatenate([layer.values, value_zeros], axis=2)
            if self.hidden is not None:
                self.hidden = mx.concatenate([self.hidden, hidden_zeros], axis=1)
        self.capacity = capacity

    def ensure_slots(self, num_slots: int) -> None:
        """Grow to at least ``num_slots`` slots; the slots held keep their states (the new
        ones are zeros, at the store's capacity)."""
        if num_slots <= self.num_slots:
            return
        extra = num_slots - self.num_slots
        for layer in self.layers:
            layer.keys = _append_zeros(layer.keys, extra, axis=0)
            layer.values = _append_zeros(layer.values, extra, axis=0)
        if self.hidden is not None:
            self.hidden = _append_zeros(self.hidden, extra, axis=0)
        self.num_slots = num_slots

    def free(self, num_slots: int | None = None) -> None:
        """Drop the arrays (the next ``ensure`` allocates afresh), with ``num_slots`` slots
        from then on when given."""
        self.layers, self.hidden, self.capacity = [], None, 0
        if num_slots is not None:
            self.num_slots = num_slots

    def copy_slot(self, source: KVStore, slot: int, into: int, length: int) -> None:
        """Copy the first ``length`` positions of ``source``'s slot ``slot`` into this store's
        slot ``into`` (which must hold them)."""
        if length == 0 or not source.layers:
            return
        for mine, theirs in zip(self.layers, source.layers, strict=True):
            mine.keys[into, :, :length] = theirs.keys[slot, :, :length]
            mine.values[into, :, :length] = theirs.values[slot, :, :length]
        if self.hidden is not None and source.hidden is not None:
            self.hidden[into, :length] = source.hidden[slot, :length]
        mx.eval([(layer.keys, layer.values) for layer in self.layers], self.hidden)

    @property
    def nbytes(self) -> int:
        """Bytes the store's arrays hold."""
        total = sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)
        return total + (0 if self.hidden is None else self.hidden.nbytes)


def _append_zeros(array: mx.array, count: int, axis: int) -> mx.array:
    """``array`` with ``count`` zero entries appended along ``axis``."""
    shape = list(array.shape)
    shape[axis] = count
    return mx.concatenate([array, mx.zeros(shape, array.dtype)], axis=axis)
