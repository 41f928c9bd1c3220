"""An attention KV cache whose length may be an array still computing.

A drafting cycle's verdict (how many drafts were accepted) is an array: reading it waits for
the forward. To build the next cycle before reading it, the MTP head's cache takes its
trims as arrays (``trim_lazily``): its offset is then a lazy [] int32, new entries are
written at it (``mx.slice_update`` with an array start), RoPE runs at it, and the mask hides
keys past it. ``bound`` is what the host knows: the offset is at most ``bound``, which sets
the buffer's capacity; ``settle`` brings it down once a trim's count is read.

The layer calling it is mlx-lm's (``cache.offset`` for RoPE, ``update_and_fetch``), with the
mask from ``make_mask`` (mlx-lm's ``create_attention_mask`` asks the cache for it).
"""

from __future__ import annotations

import mlx.core as mx

# Capacity grows in steps of this many positions (mlx-lm's KVCache step).
STEP = 256


class LazyKVCache:
    """One attention layer's keys and values [B, kv_heads, C, d], the first ``offset`` of
    them valid."""

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = mx.zeros((), mx.int32)  # lazy
        self.bound = 0  # the offset is at most this (host side)

    def _capacity(self, num_new: int) -> int:
        return -(-(self.bound + num_new) // STEP) * STEP

    def make_mask(
        self, num_new: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array:
        """[num_new, C] bool: query t (at offset + t) sees keys 0 .. offset + t."""
        if window_size is not None:
            raise ValueError("a lazy KV cache has no sliding window")
        capacity = self._capacity(num_new)
        query_end = self.offset + mx.arange(num_new, dtype=mx.int32)
        return mx.arange(capacity, dtype=mx.int32)[None] <= query_end[:, None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write keys / values [B, kv_heads, T, d] at the offset; the whole buffers."""
        num_new = keys.shape[2]
        self.reserve(num_new, keys, values)
        assert self.keys is not None and self.values is not None
        start = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
        self.values = mx.slice_update(self.values, values, start, axes=(2,))
        self.advance(num_new)
        return self.keys, self.values

    def reserve(self, num_new: int, keys: mx.array, values: mx.array) -> int:
        """Grow the buffers (zeros) to hold ``num_new`` more entries shaped like keys / values
        [B, kv_heads, T, d]; their capacity. For a caller that writes the entries itself
        (at ``offset``, then ``advance``)."""
        capacity = self._capacity(num_new)
        self.keys = _grown(self.keys, keys, capacity)
        self.values = _grown(self.values, values, capacity)
        return capacity

    def advance(self, num_new: int) -> None:
        """``num_new`` entries were written at the offset: move past them."""
        self.offset = self.offset + num_new
        self.bound += num_new

    def trim_lazily(self, num_tokens: mx.array) -> None:
        """Drop the last ``num_tokens`` ([] int32, may be lazy) entries."""
        self.offset = self.offset - num_tokens.astype(mx.int32)

    def keep_lazily(self, start: mx.array, num_kept: mx.array) -> None:
        """Of the entries written since the offset was ``start`` ([] int32, lazy), keep the
        first ``num_kept`` ([] int32, lazy): the offset becomes ``start + num_kept``, one
        graph node where advancing past them and trimming the rest are three. The host's
        ``bound`` stays (``settle`` lowers it by the trimmed count once read)."""
        self.offset = start + num_kept.astype(mx.int32)

    def settle(self, num_tokens: int) -> None:
        """A lazy trim of ``num_tokens`` was read: lower the host's bound by it."""
        self.bound -= num_tokens

    def checkpoint(self) -> tuple[mx.array, int]:
        """Where the cache is now, for ``rollback``."""
        return self.offset, self.bound

    def rollback(self, point: tuple[mx.array, int]) -> None:
        """Back to a ``checkpoint`` (later entries are overwritten by later writes)."""
        self.offset, self.bound = point


def _grown(buffer: mx.array | None, like: mx.array, capacity: int) -> mx.array:
    """``buffer`` extended with zeros to ``capacity`` positions (axis 2), shaped like ``like``."""
    if buffer is not None and buffer.shape[2] >= capacity:
        return buffer
    have = 0 if buffer is None else buffer.shape[2]
    zeros = mx.zeros((*like.shape[:2], capacity - have, like.shape[3]), like.dtype)
    return zeros if buffer is None else mx.concatenate([buffer, zeros], axis=2)
