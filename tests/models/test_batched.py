"""The batched form of a target: slots for llama-like trunks, one forward per row for
every other family."""

from __future__ import annotations

from pathlib import Path

from mtplx.models import load
from mtplx.models.batched import batched_target
from mtplx.models.per_row import PerRowTarget
from mtplx.models.slot_target import SlotTarget


def test_llama_trunks_get_the_slot_target_and_others_one_forward_per_row(
    model, qwen3_next_checkpoint: Path
) -> None:
    assert isinstance(batched_target(model.target, 4), SlotTarget)
    other = load(qwen3_next_checkpoint)
    per_row = batched_target(other.target, 4)
    assert isinstance(per_row, PerRowTarget) and per_row.recurrent
