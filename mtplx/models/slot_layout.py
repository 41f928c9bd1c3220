"""How ``SlotTarget`` lays out a forward's rows: each row a slot of a KV store, the rows'
tokens packed into one ``[1, N]`` sequence for the matmuls, and spread per group of rows to
a padded ``[R, heads, T, L]`` layout for attention in MLX ops (or read per packed token by
the fused attention kernel).

A group is a run of consecutive rows whose attention runs together: the slots
``first .. first + R - 1`` of one store (slots in the window that the forward does not feed
are computed and discarded) and a contiguous segment of the packed tokens. Building a
group's index maps and masks once per forward serves every layer.

Rows trimmed lazily (``SlotTarget.trim_lazily``) carry the count still computing: their
positions, write offsets and key counts come down by it inside the graph (``shift``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from mtplx.models.kv_store import KVStore

__all__ = [
    "ATTEND_STEP",
    "VERIFY_TOKENS",
    "SlotGroup",
    "SlotRow",
    "build_group",
    "packed_positions",
    "padded",
    "shifted_positions",
    "token_shifts",
]

# The compiled attention reads a group's keys up to its key length rounded up to a multiple of
# this, not the store's whole capacity: a coarser step reads more masked keys, a finer one
# makes more shapes (a trace each).
ATTEND_STEP = 64
# Rows feeding at most this many tokens (a verify of up to 5 drafts, plain decoding) attend
# together; longer ones (prefill chunks) in a group of their own.
VERIFY_TOKENS = 8


@dataclass(eq=False)
class SlotRow:
    """A row of ``SlotTarget``: a slot of the KV store. ``length`` counts the positions
    written; the last ``sum(unsettled)`` of them may be rejected drafts whose count is still
    computing (``SlotTarget.trim_lazily``), so ``length`` is the row's length at most."""

    slot: int
    length: int = 0
    unsettled: list[mx.array] = field(default_factory=list)  # [] int32 lazy trims, oldest first
    # Its KV lives in a store of its own (past ``shared_capacity``): it attends alone.
    private: bool = False
    # The positions it is expected to reach (its prompt's; 0: unknown): a row known to be
    # long starts in a store of its own, sized for them (no shared-store detour, no regrowth).
    expected: int = 0

    def shift(self) -> mx.array | None:
        """[] int32 (lazy): the unsettled positions, None when there are none."""
        if not self.unsettled:
            return None
        return functools.reduce(mx.add, self.unsettled)


@dataclass
class SlotGroup:
    """Rows whose attention runs together, padded to one [R, heads, T, L] layout: the slots
    first_slot .. first_slot + R - 1 (those not in the group are computed and discarded), and
    a contiguous segment [start, end) of the forward's packed tokens. ``store`` holds their
    KV, the group's slots from index ``store_first`` on (the shared store: the slot numbers;
    a long row's own store: 0)."""

    first_slot: int
    store: KVStore
    store_first: int
    num_slots: int  # R
    max_tokens: int  # T
    key_length: int  # L: the group's longest row after the forward
    start: int
    end: int
    offsets: mx.array  # [R] int32, each slot's length before the forward
    to_padded: mx.array  # [R * T] int32: packed index of each padded position (pads -> start)
    to_packed: mx.array  # [end - start] int32: padded index of each of the group's tokens
    write_at: mx.array  # [R * kv * T] int32: flat (slot, head, position) index in the store
    mask: mx.array  # [R, 1, T, L] bool: key j visible to query t of row r
    # [R, 1, 1, T, S] bool: the same over the first S = span keys (compiled layers)
    visible: mx.array | None = None
    span: int = 0  # key_length rounded up to ATTEND_STEP, at most the capacity
    # Every slot fed, in slot order, the same number of tokens (plain decoding, a batch of
    # verifies of one depth): the padded layout is the packed one, so spreading to it and
    # gathering back are the identity and need no gather (two graph nodes each, every layer).
    dense: bool = False
    # The fused attention kernel's per-token inputs (``mtplx.attention``), in packed order:
    slots: mx.array | None = None  # [end - start] int32: each token's slot in ``store``
    counts: mx.array | None = None  # [end - start] int32: the keys it sees (position + 1)


def build_group(
    rows: list[SlotRow],
    counts: list[int],
    start: int,
    store: KVStore,
    store_first: int,
    kv_heads: int,
    kernel: bool,
    visible_up_to: int,
) -> SlotGroup:
    """Index maps and the attention mask of one group, shared by every layer. ``store``
    holds the group's window of slots from ``store_first`` on; ``kernel``: attention runs
    in the fused kernel (its per-token slots and key counts are built); otherwise the
    compiled attention's mask is built for groups of at most ``visible_up_to`` tokens a row
    (0: none)."""
    slots = [row.slot for row in rows]
    first, last = min(slots), max(slots)
    num_slots, max_tokens = last - first + 1, max(counts)
    fed = {row.slot: row for row in rows}
    lengths = [fed[slot].length if slot in fed else 0 for slot in range(first, last + 1)]
    to_padded, to_packed = _token_maps(rows, counts, start, first, num_slots, max_tokens)
    position = start + len(to_packed)
    # Slots the window spans but the group does not feed write past every live row.
    starts = [lengths[r] if first + r in fed else None for r in range(num_slots)]
    write_to = _write_positions(starts, store_first, kv_heads, store.capacity, max_tokens)
    offsets = mx.array(lengths, mx.int32)
    known: list[int] | None = lengths  # the offsets as integers, where no trim is lazy
    known_shift: mx.array | None = None  # a lazy shift the known offsets still come down by
    slot_rows = [fed.get(slot) for slot in range(first, last + 1)]
    if num_slots == 1 and (shift := rows[0].shift()) is not None:
        # One row with lazy trims (a drafting cycle alone): both come down, a node each.
        offsets, write_to = _shift_down()(offsets, write_to, shift)
        known_shift = shift
    elif any(row is not None and row.unsettled for row in slot_rows):
        # Rows with lazy trims: their offsets and write positions come down by them.
        shifts = mx.stack([shift_or_zero(row) for row in slot_rows])  # [R]
        offsets = offsets - shifts
        write_to = write_to - mx.repeat(shifts, kv_heads * max_tokens)
        known = None
    key_length = max(lengths) + max_tokens
    span = min(-(-key_length // ATTEND_STEP) * ATTEND_STEP, store.capacity)
    mask, visible = _masks(offsets, max_tokens, key_length, span, visible_up_to, kernel)
    token_slots: mx.array | None = None
    counts_seen: mx.array | None = None
    if kernel:
        token_slots, counts_seen = _kernel_inputs(
            rows, counts, first, store_first, offsets, known, known_shift
        )
    dense = len(to_padded) == position - start and to_padded == list(range(start, position))
    return SlotGroup(
        first_slot=first,
        store=store,
        store_first=store_first,
        num_slots=num_slots,
        max_tokens=max_tokens,
        key_length=key_length,
        start=start,
        end=position,
        offsets=offsets,
        to_padded=mx.array(to_padded, mx.int32),
        to_packed=mx.array(to_packed, mx.int32),
        write_at=write_to,
        mask=mask[:, None],
        visible=visible,
        span=span,
        dense=dense,
        slots=token_slots,
        counts=counts_seen,
    )


@functools.cache
def _minus() -> Callable[[mx.array, mx.array], mx.array]:
    """a - b with b broadcast, compiled: one graph node where the broadcast is another."""
    return mx.compile(lambda a, b: a - b)


@functools.cache
def _shift_down() -> Callable[[mx.array, mx.array, mx.array], tuple[mx.array, mx.array]]:
    """(offsets [R], write positions [W], shift []) -> both minus the shift, compiled: a
    graph node each, with the shift broadcast inside, where the stack, the repeat and the
    subtractions are six (integer subtractions: the same values)."""
    return mx.compile(lambda offsets, write_to, shift: (offsets - shift, write_to - shift))


def _masks(
    offsets: mx.array,
    max_tokens: int,
    key_length: int,
    span: int,
    visible_up_to: int,
    kernel: bool,
) -> tuple[mx.array, mx.array | None]:
    """A group's attention masks from its slots' ``offsets`` ([R] int32): key j visible to
    query t of row r ([R, T, L] bool), and the compiled attention's mask over the first
    ``span`` keys ([R, 1, 1, T, S] bool; None when the fused kernel runs the attention or a
    row feeds more than ``visible_up_to`` tokens)."""
    query_end = offsets[:, None] + mx.arange(max_tokens)[None, :]  # [R, T]
    mask = mx.arange(key_length)[None, None, :] <= query_end[:, :, None]  # [R, T, L]
    if kernel or max_tokens > visible_up_to:
        return mask, None
    visible = mx.arange(span)[None, None, :] <= query_end[:, :, None]
    return mask, visible[:, None, None]


def _token_maps(
    rows: list[SlotRow],
    counts: list[int],
    start: int,
    first: int,
    num_slots: int,
    max_tokens: int,
) -> tuple[list[int], list[int]]:
    """A group's maps between its packed tokens (from ``start`` on) and its padded layout
    of R x T positions (slot ``first`` first): the packed index of each padded position
    (pads -> ``start``), and the padded index of each packed token."""
    to_padded = [start] * (num_slots * max_tokens)
    to_packed = []
    position = start
    for row, count in zip(rows, counts, strict=True):
        base = (row.slot - first) * max_tokens
        for t in range(count):
            to_padded[base + t] = position + t
            to_packed.append(base + t)
        position += count
    return to_padded, to_packed


def _write_positions(
    starts: list[int | None], store_first: int, kv_heads: int, capacity: int, max_tokens: int
) -> mx.array:
    """[R * kv * T] int32: the flat (slot, head, position) index in the store of each
    padded position, each slot's from its ``starts`` entry on (None: a slot the group does
    not feed, written in the store's last T positions, past every live row: see
    ``SlotTarget._groups``)."""
    garbage = capacity - max_tokens
    return mx.array(
        [
            ((store_first + r) * kv_heads + h) * capacity
            + (garbage if length is None else length)
            + t
            for r, length in enumerate(starts)
            for h in range(kv_heads)
            for t in range(max_tokens)
        ],
        mx.int32,
    )


def _kernel_inputs(
    rows: list[SlotRow],
    counts: list[int],
    first: int,
    store_first: int,
    offsets: mx.array,
    known: list[int] | None,
    shift: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """The fused attention kernel's per packed token inputs: its slot in the store, and the
    keys it sees (its row's offset, lazy trims included, + its index in the row's tokens
    + 1); both [tokens] int32. ``known``: the offsets as integers where no trim is lazy (the
    counts are then a constant, not three graph nodes every step), or before ``shift`` ([]
    int32, lazy: one row's trims) comes off them (then one node, the constant minus the
    shift: integers, so the values of the offsets' gather plus the steps)."""
    window = [row.slot - first for row, c in zip(rows, counts, strict=True) for _ in range(c)]
    steps = [t + 1 for c in counts for t in range(c)]
    token_slots = mx.array([store_first + r for r in window], mx.int32)
    if known is not None:
        seen = mx.array([known[r] + s for r, s in zip(window, steps, strict=True)], mx.int32)
        return token_slots, seen if shift is None else _minus()(seen, shift)
    return token_slots, offsets[mx.array(window, mx.int32)] + mx.array(steps, mx.int32)


def padded(projected: mx.array, group: SlotGroup, num_heads: int) -> mx.array:
    """A group's share of packed projections in its padded layout: [N, heads, 1, d] ->
    [R, heads, T, d] (pads repeat the group's first token)."""
    if not group.dense:
        spread = projected[group.to_padded]
    elif group.start == 0 and group.end == projected.shape[0]:
        spread = projected
    else:
        spread = projected[group.start : group.end]
    return spread.reshape(group.num_slots, group.max_tokens, num_heads, -1).transpose(0, 2, 1, 3)


def token_shifts(rows: Sequence[SlotRow], counts: Sequence[int]) -> mx.array | None:
    """[N] int32 (lazy): each packed token's row's unsettled positions (``SlotRow.shift``),
    None when no row has any."""
    if not any(row.unsettled for row in rows):
        return None
    return mx.concatenate(
        [
            mx.broadcast_to(shift_or_zero(row), (count,))
            for row, count in zip(rows, counts, strict=True)
        ]
    )


def shift_or_zero(row: SlotRow | None) -> mx.array:
    """[] int32: the row's unsettled positions (0 for no row)."""
    shift = None if row is None else row.shift()
    return mx.zeros((), mx.int32) if shift is None else shift


def shifted_positions(rows: Sequence[SlotRow], counts: Sequence[int]) -> mx.array:
    """Each packed token's position in its row after the rows' lazy trims (``SlotRow.shift``):
    [N] int32, lazy where a trim is; one row's shift comes off in one node (the broadcast
    inside a compiled subtraction)."""
    positions = packed_positions(rows, counts)
    if len(rows) == 1 and (shift := rows[0].shift()) is not None:
        return _minus()(positions, shift)
    shifts = token_shifts(rows, counts)
    return positions if shifts is None else positions - shifts


def packed_positions(rows: Sequence[SlotRow], counts: Sequence[int]) -> mx.array:
    """Each packed token's position in its row, for RoPE on the packed projections: [N]."""
    return mx.array(
        [row.length + t for row, count in zip(rows, counts, strict=True) for t in range(count)],
        mx.int32,
    )
