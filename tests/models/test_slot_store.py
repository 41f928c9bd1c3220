"""The slot target's rows and stores: slots are reused and never shared, an idle store
is freed, and a long row moves to a store of its own with the same bits."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtplx.models.kv_store import SLOT_STEP
from mtplx.models.slot_store import IDLE_CAPACITY
from mtplx.models.slot_target import SlotTarget
from tests.models.slots import fed_rows, prompt


def test_released_slots_are_reused_and_never_shared(model) -> None:
    target = SlotTarget(model.target, max_rows=2)
    first, second = target.new_row(), target.new_row()
    with pytest.raises(RuntimeError, match="slots"):
        target.new_row()
    target.release(first)
    third = target.new_row()
    assert third.slot == 0 and second.slot == 1
    with pytest.raises(ValueError, match="own live slot"):
        target.forward([third, third], [mx.array([1]), mx.array([2])])


def test_an_idle_store_grown_by_a_long_row_is_freed(model) -> None:
    """Once the last row leaves, a store grown past IDLE_CAPACITY is dropped; the next rows
    allocate afresh and give the bits of a fresh target."""
    target = SlotTarget(model.target, max_rows=4)
    (long_row,) = fed_rows(target, [IDLE_CAPACITY + 1])
    short = target.new_row()
    target.release(long_row)
    assert target._shared.capacity > IDLE_CAPACITY  # a row still runs: the store stays
    target.release(short)
    assert target._shared.capacity == 0 and not target._shared.layers
    (again,) = fed_rows(target, [40])
    fresh = SlotTarget(model.target, max_rows=4)
    (fresh_row,) = fed_rows(fresh, [40])
    (got,) = target.forward([again], [mx.array([3, 4])])
    (want,) = fresh.forward([fresh_row], [mx.array([3, 4])])
    assert mx.array_equal(got.logits, want.logits).item()
    assert target._shared.capacity == fresh._shared.capacity


def test_a_long_row_moves_to_a_store_of_its_own_with_the_same_bits(model) -> None:
    """A row that outgrows the shared store moves to a store of its own and attends alone:
    every output (beside two short rows, across the move, in prompt chunks and decode steps)
    is the same bits as with one store for all; the shared store stays short, and the long
    row's store is freed with it."""
    shared = SlotTarget(model.target, max_rows=4, keep_hidden=True)
    split = SlotTarget(model.target, max_rows=4, keep_hidden=True)
    split.shared_capacity = 256
    for target in (shared, split):
        fed_rows(target, [40, 10])
        target.new_row()
    rows = {id(t): list(t._live.values()) for t in (shared, split)}
    long_prompt = prompt(5, 300)
    fed = 0
    while fed < 360:
        chunk = long_prompt[fed : fed + 64] if fed < 300 else mx.array([fed % 250 + 3], mx.int32)
        outputs = []
        for target in (shared, split):
            short_a, short_b, long_row = rows[id(target)]
            out = target.forward(
                [short_a, long_row, short_b], [mx.array([fed % 7 + 3]), chunk, mx.array([9])]
            )
            mx.eval([(o.logits, o.hidden) for o in out])
            outputs.append(out)
        for mine, theirs in zip(*outputs, strict=True):
            assert mx.array_equal(mine.logits, theirs.logits).item(), fed
            assert mx.array_equal(mine.hidden, theirs.hidden).item(), fed
        fed += int(chunk.shape[0])
    long_row = rows[id(split)][2]
    assert long_row.private and not rows[id(split)][0].private
    assert split._shared.capacity <= 256 < shared._shared.capacity
    # The long row's store holds it alone: one slot, not four, at its length.
    assert split._private[long_row.slot].num_slots == 1
    assert split._private[long_row.slot].capacity == shared._shared.capacity == 512
    assert split.kv_nbytes < shared.kv_nbytes
    saved = [t.save_block(rows[id(t)][2], 200, 330) for t in (shared, split)]
    for name in ("keys", "values", "hidden"):
        assert mx.array_equal(getattr(saved[0], name), getattr(saved[1], name)).item()
    split.release(long_row)
    assert not split._private


def test_a_row_announced_long_starts_in_a_store_of_its_own(model) -> None:
    """A row whose prompt will outgrow the shared store (``new_row(expected_length)``) takes
    a store of its own at its first forward, sized for the prompt: the shared store is never
    allocated for it and its own store never regrows during the prompt; every output is the
    same bits as an unannounced row's in a store shared by all."""
    shared = SlotTarget(model.target, max_rows=4, keep_hidden=True)
    announced = SlotTarget(model.target, max_rows=4, keep_hidden=True)
    announced.shared_capacity = 256
    rows = [shared.new_row(), announced.new_row(expected_length=300)]
    long_prompt = prompt(5, 300)
    stores = set()
    for fed in [*range(0, 300, 64), 300]:  # the prompt in chunks, then a decode step
        chunk = long_prompt[fed : fed + 64] if fed < 300 else mx.array([7], mx.int32)
        outputs = [t.forward([r], [chunk]) for t, r in zip((shared, announced), rows, strict=True)]
        mx.eval([(o[0].logits, o[0].hidden) for o in outputs])
        assert mx.array_equal(outputs[0][0].logits, outputs[1][0].logits).item(), fed
        assert mx.array_equal(outputs[0][0].hidden, outputs[1][0].hidden).item(), fed
        own = announced._private[rows[1].slot]
        stores.add(id(own))
        assert rows[1].private and own.capacity == 512 and own.num_slots == 1
        assert not announced._shared.layers  # nothing of the long row went through it
    assert len(stores) == 1
    announced.release(rows[1])
    assert not announced._private


def test_the_shared_store_grows_its_slots_with_the_rows_in_use(model) -> None:
    """One row holds one step of slots, not max_rows of them; a row that takes a higher slot
    grows the store without changing a bit of the rows already in it; an idle store goes
    back to one step."""
    target = SlotTarget(model.target, max_rows=12)
    reference = SlotTarget(model.target, max_rows=12)
    reference._shared.ensure_slots(12)  # every slot from the start, as a fixed-size store
    rows = {id(t): fed_rows(t, [30, 20]) for t in (target, reference)}
    assert target._shared.num_slots == SLOT_STEP
    assert target.kv_nbytes * 3 == reference.kv_nbytes
    for t in (target, reference):  # slots 2..6 taken, the last one fed: the store grows
        rows[id(t)] += [t.new_row() for _ in range(5)]
        mx.eval(t.forward([rows[id(t)][-1]], [prompt(6, 12)], "last")[0].logits)
    assert target._shared.num_slots == 2 * SLOT_STEP
    for t in (target, reference):
        rows[id(t)] = [rows[id(t)][0], rows[id(t)][1], rows[id(t)][-1]]
    outputs = [
        t.forward(rows[id(t)], [mx.array([5, 6]), mx.array([7]), mx.array([8, 9, 10])])
        for t in (target, reference)
    ]
    for mine, theirs in zip(*outputs, strict=True):
        assert mx.array_equal(mine.logits, theirs.logits).item()
    for row in list(target._live.values()):
        target.release(row)
    assert target._shared.num_slots == SLOT_STEP and not target._shared.layers
