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


def test_in_flight_holds_work_by_row_and_drops_all_of_a_row() -> None:
    from mtplx.cycle import CycleResult
    from mtplx.step import InFlight

    queued_plain, waiting, other = (cast(Sequence, object()) for _ in range(3))
    in_flight = InFlight()
    in_flight.plain[queued_plain] = cast(Any, "ahead")
    in_flight.committed[queued_plain] = CycleResult([1], 0, 0, cast(Any, None), 0.0, 0.0)
    in_flight.planned[waiting] = Plan("mtp", 2)
    in_flight.committed[other] = CycleResult([2], 0, 0, cast(Any, None), 0.0, 0.0)
    assert queued_plain in in_flight and waiting in in_flight
    assert other not in in_flight  # committed, to be emitted: nothing runs ahead for it
    in_flight.drop(queued_plain)
    in_flight.drop(waiting)
    assert queued_plain not in in_flight and waiting not in in_flight
    assert list(in_flight.committed) == [other] and not in_flight.plain and not in_flight.planned
