"""A forward's layout of slot rows: a group's index maps, write positions and masks, worked
out by hand for a small case, and the lazy shifts of rows trimmed by a count still
computing."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np

from mtplx.models.kv_store import KVStore
from mtplx.models.slot_layout import (
    SlotRow,
    build_group,
    packed_positions,
    padded,
    shifted_positions,
    token_shifts,
)

KV_HEADS = 2


def _store(num_slots: int) -> KVStore:
    store = KVStore(
        num_slots=num_slots,
        num_layers=1,
        kv_heads=KV_HEADS,
        head_dim=4,
        hidden_size=8,
        dtype=mx.float32,
        keep_hidden=False,
    )
    store.ensure(16)
    return store


def _write_at(capacity: int, lengths: list[int | None], max_tokens: int) -> list[int]:
    """Where each (slot, head, token) of the padded layout is written: after the slot's
    length, or for a slot the group does not feed (None) in the store's last positions."""
    garbage = capacity - max_tokens
    return [
        (r * KV_HEADS + h) * capacity + (garbage if length is None else length) + t
        for r, length in enumerate(lengths)
        for h in range(KV_HEADS)
        for t in range(max_tokens)
    ]


def test_a_group_spanning_an_unfed_slot_maps_and_masks_every_token() -> None:
    """Slots 0 (3 positions, feeds 2) and 2 (5 positions, feeds 1), packed from token 4 on:
    a window of 3 slots, 2 tokens a slot; slot 1 is computed into the store's last
    positions and discarded."""
    store = _store(3)
    rows = [SlotRow(0, 3), SlotRow(2, 5)]
    group = build_group(rows, [2, 1], 4, store, 0, KV_HEADS, kernel=True, visible_up_to=0)
    assert (group.num_slots, group.max_tokens, group.key_length) == (3, 2, 7)
    assert (group.start, group.end, group.dense) == (4, 7, False)
    assert group.to_padded.tolist() == [4, 5, 4, 4, 6, 4]  # pads repeat the first token
    assert group.to_packed.tolist() == [0, 1, 4]
    assert group.offsets.tolist() == [3, 0, 5]
    assert group.write_at.tolist() == _write_at(store.capacity, [3, None, 5], 2)
    # Query t of slot r sees keys 0 .. offset + t.
    query_end = np.array([3, 0, 5])[:, None] + np.arange(2)[None, :]  # [R, T]
    want = np.arange(7)[None, None, :] <= query_end[:, :, None]  # [R, T, L]
    assert np.array_equal(np.array(group.mask[:, 0]), want)
    # The fused kernel's inputs: each packed token's slot and the keys it sees.
    assert group.slots is not None and group.counts is not None
    assert group.slots.tolist() == [0, 0, 2]
    assert group.counts.tolist() == [4, 5, 6]
    assert group.visible is None


def test_the_compiled_mask_covers_the_span_for_short_groups_only() -> None:
    store = _store(2)
    rows = [SlotRow(0, 3), SlotRow(1, 1)]
    group = build_group(rows, [2, 2], 0, store, 0, KV_HEADS, kernel=False, visible_up_to=2)
    assert group.slots is None and group.counts is None
    assert group.visible is not None and group.span == 64
    assert group.visible.shape == (2, 1, 1, 2, 64)
    visible = np.array(group.visible[:, 0, 0])
    assert np.array_equal(visible[:, :, : group.key_length], np.array(group.mask[:, 0]))
    assert not visible[:, :, group.key_length :].any()  # past every row: never visible
    longer = build_group(rows, [3, 3], 0, store, 0, KV_HEADS, kernel=False, visible_up_to=2)
    assert longer.visible is None


def test_slots_fed_alike_in_order_are_dense() -> None:
    """Every slot of the window fed the same count, in slot order: the padded layout is the
    packed one, and spreading to it is the identity."""
    store = _store(3)
    rows = [SlotRow(0, 2), SlotRow(1, 7), SlotRow(2, 4)]
    group = build_group(rows, [2, 2, 2], 0, store, 0, KV_HEADS, kernel=True, visible_up_to=0)
    assert group.dense and group.to_padded.tolist() == list(range(6))
    projected = mx.arange(6 * KV_HEADS * 4).reshape(6, KV_HEADS, 1, 4)  # [N, kv, 1, d]
    spread = padded(projected, group, KV_HEADS)  # [R, kv, T, d]
    gathered = projected[group.to_padded].reshape(3, 2, KV_HEADS, 4).transpose(0, 2, 1, 3)
    assert mx.array_equal(spread, gathered).item()
    uneven = build_group(rows, [2, 1, 2], 0, store, 0, KV_HEADS, kernel=True, visible_up_to=0)
    assert not uneven.dense


def test_a_lazy_trim_comes_off_positions_offsets_and_writes() -> None:
    """A row trimmed by a count still computing (2, then 1) attends, writes and ropes as a
    row 3 positions shorter; the other row is untouched."""
    store = _store(2)
    trimmed = SlotRow(0, 9, unsettled=[mx.array(2, mx.int32), mx.array(1, mx.int32)])
    plain = SlotRow(1, 4)
    rows, counts = [trimmed, plain], [2, 1]
    group = build_group(rows, counts, 0, store, 0, KV_HEADS, kernel=True, visible_up_to=0)
    assert group.offsets.tolist() == [6, 4]
    assert group.write_at.tolist() == _write_at(store.capacity, [6, 4], 2)
    assert group.counts is not None and group.counts.tolist() == [7, 8, 5]
    shifts = token_shifts(rows, counts)
    assert shifts is not None and shifts.tolist() == [3, 3, 0]
    assert (packed_positions(rows, counts) - shifts).tolist() == [6, 7, 4]
    assert token_shifts([plain], [1]) is None


def _nodes(*arrays: mx.array) -> int:
    graph = io.StringIO()
    mx.export_to_dot(graph, *arrays)
    return graph.getvalue().count("shape=rectangle")


def test_one_lazily_trimmed_row_comes_down_in_few_nodes() -> None:
    """A drafting cycle's row alone (2 verify tokens, its last verdict's trim still
    computing): its offset, write positions, key counts and RoPE positions are those of the
    row shorter by the trim, in one graph node each (no repeat or stack of the shift, no
    gather of the offset for the counts)."""
    store = _store(3)
    shift = mx.array(1, mx.int32)
    mx.eval(shift)
    trimmed = SlotRow(2, 9, unsettled=[shift])
    group = build_group([trimmed], [2], 0, store, 0, KV_HEADS, kernel=True, visible_up_to=0)
    assert group.offsets.tolist() == [8]
    assert group.write_at.tolist() == _write_at(store.capacity, [8], 2)[: KV_HEADS * 2]
    assert group.counts is not None and group.counts.tolist() == [9, 10]
    fresh = build_group([trimmed], [2], 0, store, 0, KV_HEADS, kernel=True, visible_up_to=0)
    assert _nodes(fresh.offsets, fresh.write_at) == 2  # a subtraction each
    assert fresh.counts is not None and _nodes(fresh.counts) == 1  # its constant minus the shift
    positions = shifted_positions([trimmed], [2])
    assert positions.tolist() == [8, 9]
    assert _nodes(shifted_positions([trimmed], [2])) == 1  # the subtraction alone
    plain = SlotRow(1, 4)
    assert shifted_positions([plain], [1]).tolist() == [4]
    both = shifted_positions([trimmed, plain], [2, 1])
    assert both.tolist() == [8, 9, 4]
