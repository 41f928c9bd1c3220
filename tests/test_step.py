"""mtplx.step: the plain data between a step's schedule, run and postprocess."""

from __future__ import annotations

from typing import Any, cast

from mtplx.planner import Plan
from mtplx.sequence import Sequence
from mtplx.step import StepBatch


def test_rows_go_in_forward_order_and_chunks_do_not_decode() -> None:
    plain, drafting, ahead, prompt = (cast(Sequence, object()) for _ in range(4))
    plans: dict[Any, Plan] = {plain: Plan(None, 0), drafting: Plan("mtp", 2)}
    batch = StepBatch(plans, [plain], [drafting], [ahead], chunks=[(prompt, [1, 2, 3])])
    assert batch.rows == [plain, drafting, ahead, prompt]
    assert batch.num_decoding == 3
    assert StepBatch({}).rows == [] and StepBatch({}).num_decoding == 0
