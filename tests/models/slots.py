"""Helpers of the slot target's tests: prompts, and rows fed them."""

from __future__ import annotations

import mlx.core as mx

from mtplx.models.slot_layout import SlotRow
from mtplx.models.slot_target import SlotTarget


def prompt(i: int, length: int) -> mx.array:
    """A deterministic prompt of ``length`` tokens, different for each ``i``: [length]."""
    return mx.array([(5 + 7 * i + 13 * j * j) % 250 + 3 for j in range(length)], mx.int32)


def fed_rows(target: SlotTarget, lengths: list[int]) -> list[SlotRow]:
    """New rows of ``target``, row i fed ``prompt(i, lengths[i])`` in one forward."""
    rows = []
    for i, length in enumerate(lengths):
        row = target.new_row()
        mx.eval(target.forward([row], [prompt(i, length)], "last")[0].logits)
        rows.append(row)
    return rows
