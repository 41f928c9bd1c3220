"""The bridge: one engine thread, FIFO tickets, bounded queue, cancellation, timeouts and
failure isolation, driven from asyncio with the deterministic fake engine."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from mtplx.request import FinishEvent, GenerationRequest, SamplerConfig
from server.bridge_errors import EngineNotReady, GenerationFailed, QueueFull, RequestTimeout
from server.engine_bridge import EngineBridge
from tests.fake_engine import FakeEngine


def _request(prompt: str, max_tokens: int = 8, seed: int | None = 0) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=list(prompt.encode()),
        sampler=SamplerConfig(temperature=0.7, seed=seed),
        max_tokens=max_tokens,
    )


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def bridge(engine: FakeEngine):
    sched = EngineBridge.from_engine(engine, max_queue=4, request_timeout=10.0)
    sched.start()
    assert sched.wait_ready(5)
    yield sched
    sched.stop()


async def _collect(ticket) -> tuple[str, str]:
    text, reason = "", ""
    async with ticket:
        async for _, event in ticket:
            text += event.text  # token pieces, then the finish event's held-back tail
            if isinstance(event, FinishEvent):
                reason = event.finish_reason
    return text, reason


async def _wait_for(predicate, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.005)


def test_single_request_yields_tokens_then_finish(bridge, engine):
    request = _request("hi", max_tokens=12)

    async def main():
        return await _collect(bridge.submit(request))

    text, reason = asyncio.run(main())
    assert text == engine.expected_text(request)
    assert reason == "length"
    assert bridge.stats().completed == 1


def test_multi_request_ticket_runs_its_choices_as_rows_of_one_batch(bridge, engine):
    requests = [_request("a", seed=1), _request("b", seed=2)]

    async def main():
        seen: dict[int, list] = {0: [], 1: []}
        order = []
        async for index, event in bridge.submit(requests):
            seen[index].append(event)
            order.append(index)
        return seen, order

    seen, order = asyncio.run(main())
    assert order[:4] == [0, 1, 0, 1]  # both choices advance in every step
    for index, request in enumerate(requests):
        assert isinstance(seen[index][-1], FinishEvent)
        assert "".join(e.text for e in seen[index]) == engine.expected_text(request)


def test_tickets_start_fifo_and_share_steps_up_to_max_num_seqs():
    engine = FakeEngine(max_num_seqs=3, token_delay=0.002)
    sched = EngineBridge.from_engine(engine, max_queue=16)
    sched.start()

    async def main():
        tickets = [sched.submit(_request(f"p{i}", max_tokens=5)) for i in range(6)]
        return await asyncio.gather(*(_collect(t) for t in tickets))

    try:
        results = asyncio.run(main())
    finally:
        sched.stop()
    assert engine.max_concurrent == 3  # three rows at once, never more
    starts = [label for kind, label in engine.log if kind == "start"]
    assert starts == [f"p{i}" for i in range(6)]
    for i, (text, _) in enumerate(results):
        assert text == engine.expected_text(_request(f"p{i}", max_tokens=5))
    assert len(engine.threads) == 1  # every engine call on the worker thread
    assert engine.num_steps < 6 * 6  # steps were shared, not one request after another


def test_a_new_request_joins_the_running_batch_at_the_next_step():
    engine = FakeEngine(max_num_seqs=4, token_delay=0.01)
    sched = EngineBridge.from_engine(engine)
    sched.start()

    async def main():
        long = sched.submit(_request("long", max_tokens=10_000))
        async for _index, _event in long:
            break  # running
        steps = engine.num_steps
        text, _ = await _collect(sched.submit(_request("short", max_tokens=4)))
        joined_after = engine.num_steps - steps
        long.cancel()
        return text, joined_after

    text, joined_after = asyncio.run(main())
    sched.stop()
    assert text == engine.expected_text(_request("short", max_tokens=4))
    assert joined_after <= 4 + 3  # its tokens and a finish, not the long request's 10 000


def test_engine_runs_on_the_worker_thread_that_built_it():
    threads = {}

    def factory():
        threads["load"] = threading.current_thread()
        return FakeEngine()

    sched = EngineBridge(factory)
    sched.start()
    assert sched.wait_ready(5)

    async def main():
        await _collect(sched.submit(_request("x")))

    asyncio.run(main())
    sched.stop()
    assert threads["load"] is not threading.main_thread()
    assert threads["load"].name == "mtplx-engine"


def test_full_queue_raises_queue_full_with_retry_after():
    engine = FakeEngine(max_num_seqs=1, token_delay=0.01)
    sched = EngineBridge.from_engine(engine, max_queue=2)
    sched.start()

    async def main():
        running = sched.submit(_request("run", max_tokens=200))
        await _wait_for(lambda: sched.active == 1)
        waiting = [sched.submit(_request(f"w{i}")) for i in range(2)]
        assert sched.queue_depth == 2
        with pytest.raises(QueueFull) as info:
            sched.submit(_request("over"))
        assert info.value.retry_after >= 1
        for ticket in [running, *waiting]:
            ticket.cancel()

    asyncio.run(main())
    sched.stop()


def test_requests_waiting_for_the_grammar_thread_are_bounded_by_the_queue():
    """Grammars compile on one thread: requests waiting for it count against max_queue, so
    a flood of slow grammars is refused (429) instead of piling up."""
    from mtplx.grammar import GrammarSpec

    engine = FakeEngine()
    release = threading.Event()
    engine.prepare = lambda request: release.wait(10)  # a grammar that compiles slowly
    sched = EngineBridge.from_engine(engine, max_queue=2)
    sched.start()
    constrained = GenerationRequest(list(b"x"), grammar=GrammarSpec("regex", "a+"))

    async def main():
        waiting = [asyncio.ensure_future(sched.prepare([constrained])) for _ in range(2)]
        await _wait_for(lambda: sched._preparing == 2)
        with pytest.raises(QueueFull):
            await sched.prepare([constrained])
        await sched.prepare([_request("plain")])  # no grammar: nothing to wait for
        release.set()
        await asyncio.gather(*waiting)
        assert sched._preparing == 0

    asyncio.run(main())
    sched.stop()


def test_cancel_running_ticket_frees_engine_within_one_cycle(engine):
    engine.token_delay = 0.02
    sched = EngineBridge.from_engine(engine)
    sched.start()

    async def main():
        ticket = sched.submit(_request("long", max_tokens=10_000))
        async for _index, _event in ticket:
            break  # one token seen: the request is running
        ticket.cancel()
        started = time.monotonic()
        text, _ = await _collect(sched.submit(_request("next", max_tokens=6)))
        return time.monotonic() - started, text

    elapsed, text = asyncio.run(main())
    sched.stop()
    assert ("closed", "long") in engine.log
    assert text
    assert elapsed < 0.5  # one cycle (20 ms) plus three tokens, not 10 000 tokens


def test_cancel_waiting_ticket_leaves_the_queue():
    engine = FakeEngine(max_num_seqs=1, token_delay=0.01)
    sched = EngineBridge.from_engine(engine)
    sched.start()

    async def main():
        running = sched.submit(_request("run", max_tokens=100))
        await _wait_for(lambda: sched.active == 1)
        waiting = sched.submit(_request("waiting"))
        assert sched.queue_depth == 1
        async with waiting:
            pass  # leaving the block without reading cancels
        assert sched.queue_depth == 0
        running.cancel()
        await _wait_for(lambda: sched.active == 0)

    asyncio.run(main())
    sched.stop()
    assert ("start", "waiting") not in engine.log


def test_failure_is_delivered_to_that_ticket_only(bridge, engine):
    async def main():
        with pytest.raises(GenerationFailed) as info:
            await _collect(bridge.submit(_request("[[fail]]")))
        assert isinstance(info.value.__cause__, RuntimeError)
        return await _collect(bridge.submit(_request("after")))

    text, reason = asyncio.run(main())
    assert text == engine.expected_text(_request("after")) and reason == "length"
    assert bridge.stats().failed == 1


def test_timeout_stops_the_request(engine):
    engine.token_delay = 0.01
    sched = EngineBridge.from_engine(engine, request_timeout=0.1)
    sched.start()

    async def main():
        with pytest.raises(RequestTimeout):
            await _collect(sched.submit(_request("slow", max_tokens=10_000)))
        await _wait_for(lambda: sched.active == 0, timeout=1.0)

    asyncio.run(main())
    sched.stop()


def test_validate_errors_raise_before_queueing(bridge):
    async def main():
        with pytest.raises(ValueError, match="context length"):
            bridge.submit(_request("x" * 5000))
        assert bridge.queue_depth == 0

    asyncio.run(main())


def test_loading_then_ready_and_load_failure():
    gate = threading.Event()

    def slow_factory():
        gate.wait(5)
        return FakeEngine()

    sched = EngineBridge(slow_factory)
    sched.start()

    with pytest.raises(EngineNotReady) as info:
        asyncio.run(_submit(sched))
    assert info.value.retry_after and sched.state == "loading"
    gate.set()
    assert sched.wait_ready(5) and sched.state == "ready"
    sched.stop()

    def broken():
        raise OSError("no such checkpoint")

    failed = EngineBridge(broken)
    failed.start()
    assert not failed.wait_ready(5)
    assert failed.state == "failed"
    with pytest.raises(EngineNotReady, match="no such checkpoint"):
        asyncio.run(_submit(failed))


async def _submit(sched: EngineBridge):
    return sched.submit(_request("x"))


def test_stop_fails_waiting_and_running_tickets():
    engine = FakeEngine(max_num_seqs=1, token_delay=0.01)
    sched = EngineBridge.from_engine(engine)
    sched.start()

    async def main():
        running = sched.submit(_request("run", max_tokens=1000))
        await _wait_for(lambda: sched.active == 1)
        waiting = sched.submit(_request("wait"))
        await asyncio.to_thread(sched.stop)
        with pytest.raises(EngineNotReady):
            await _collect(waiting)
        with pytest.raises(EngineNotReady, match="shutting down"):
            await _collect(running)  # ends with an error instead of hanging

    asyncio.run(main())


def test_stop_ends_running_tickets_while_a_step_is_stuck():
    """A long step (a prompt chunk on a loaded machine) must not hold the readers: each
    gets its error when ``stop`` runs, not when the step returns."""
    stuck, release = threading.Event(), threading.Event()

    class StuckEngine(FakeEngine):
        def step(self):
            stuck.set()
            release.wait(10)
            return super().step()

    engine = StuckEngine(max_num_seqs=1)
    sched = EngineBridge.from_engine(engine, max_queue=4, request_timeout=30.0)
    sched.start()
    assert sched.wait_ready(5)

    async def main():
        running = sched.submit(_request("a"))
        await asyncio.get_running_loop().run_in_executor(None, stuck.wait, 5)
        stopper = threading.Thread(target=sched.stop, kwargs={"timeout": 10.0})
        stopper.start()
        with pytest.raises(EngineNotReady, match="shutting down"):
            await asyncio.wait_for(_collect(running), timeout=5)
        assert stopper.is_alive()  # the step has not returned yet
        release.set()
        await asyncio.to_thread(stopper.join, 10)

    try:
        asyncio.run(main())
        assert sched.state == "stopped" and sched.stats().cancelled == 1
    finally:
        release.set()
        sched.stop()


def test_idle_engine_admits_a_burst_up_to_capacity():
    engine = FakeEngine(max_num_seqs=2, token_delay=0.005)
    sched = EngineBridge.from_engine(engine, max_queue=1)
    sched.start()

    async def main():
        # Two tickets are about to run (the batch has room for both): they do not take the
        # one waiting slot, and a third does; a fourth is refused.
        tickets = [sched.submit(_request(name)) for name in ("one", "two", "three")]
        with pytest.raises(QueueFull):
            sched.submit(_request("four"))
        await asyncio.gather(*(_collect(t) for t in tickets))

    asyncio.run(main())
    sched.stop()


def test_drain_lets_running_tickets_finish_and_refuses_new_ones():
    engine = FakeEngine(max_num_seqs=2, token_delay=0.005)
    sched = EngineBridge.from_engine(engine)
    sched.start()

    async def main():
        short = sched.submit(_request("short", max_tokens=20))
        long = sched.submit(_request("long", max_tokens=100_000))
        await _wait_for(lambda: sched.active == 2)
        # The short ticket needs ~0.05 s of steps; the margin is for a loaded machine (1 s
        # was not always enough), the long one cannot finish in any case.
        waiter = sched.drain(timeout=5.0)
        assert sched.state == "draining"
        with pytest.raises(EngineNotReady, match="shutting down"):
            sched.submit(_request("late"))
        text, reason = await _collect(short)  # finishes normally within the drain
        assert reason == "length" and text == engine.expected_text(_request("short", 20))
        with pytest.raises(EngineNotReady, match="shutting down"):
            await _collect(long)  # still running at the deadline: ended with an error
        await asyncio.to_thread(waiter.join, 10)

    asyncio.run(main())
    assert sched.state == "stopped"


def test_a_reader_that_stops_reading_is_cancelled():
    engine = FakeEngine(max_num_seqs=2, token_delay=0.0)
    sched = EngineBridge.from_engine(engine, max_backlog=50)
    sched.start()

    async def main():
        stalled = sched.submit(_request("stalled", max_tokens=100_000))
        await _wait_for(lambda: sched.stats().cancelled == 1, timeout=10)
        assert sched.slow_readers == 1
        assert ("closed", "stalled") in engine.log  # its row left the batch
        assert stalled._sent - stalled._read <= 50 + 3  # the backlog stayed bounded
        text, _ = await _collect(sched.submit(_request("reader", max_tokens=8)))
        assert text

    asyncio.run(main())
    sched.stop()


def test_fail_ends_running_and_waiting_tickets_and_refuses_new_ones():
    """A lost pipeline rank: ``fail`` runs on another thread while a step is stuck."""
    stuck, release = threading.Event(), threading.Event()

    class StuckEngine(FakeEngine):
        def step(self):
            stuck.set()
            release.wait(10)
            return super().step()

    engine = StuckEngine(max_num_seqs=1)
    sched = EngineBridge.from_engine(engine, max_queue=4, request_timeout=10.0)
    sched.start()
    assert sched.wait_ready(5)
    failure = EngineNotReady("a pipeline rank was lost")

    async def main():
        running = sched.submit(_request("a"))
        waiting = sched.submit(_request("b"))
        await asyncio.get_running_loop().run_in_executor(None, stuck.wait, 5)
        sched.fail(failure)
        for ticket in (running, waiting):
            with pytest.raises(EngineNotReady, match="pipeline rank was lost"):
                await _collect(ticket)
        with pytest.raises(EngineNotReady, match="pipeline rank was lost"):
            sched.submit(_request("c"))

    try:
        asyncio.run(main())
        assert sched.state == "failed"
        assert sched.stats().failed == 2
    finally:
        release.set()
        sched.stop()
    assert sched.state == "failed"  # stop keeps the reason /health reports


def test_retry_after_counts_the_batches_the_waiting_tickets_need():
    engine = FakeEngine(max_num_seqs=2, token_delay=0.01)
    sched = EngineBridge.from_engine(engine, max_queue=4)
    sched.start()

    async def main():
        running = [sched.submit(_request(f"run{i}", max_tokens=2000)) for i in range(2)]
        await _wait_for(lambda: sched.active == 2)
        waiting = [sched.submit(_request(f"w{i}", max_tokens=2000)) for i in range(4)]
        sched._mean_seconds = 2.0
        with pytest.raises(QueueFull) as info:
            sched.submit(_request("over"))
        # 4 waiting + this one, 2 at a time: 3 batches of 2 s (not 5 tickets x 2 s).
        assert info.value.retry_after == 6
        for ticket in [*running, *waiting]:
            ticket.cancel()

    asyncio.run(main())
    sched.stop()


def test_stop_while_the_model_loads_does_not_wait_for_the_load():
    """A stopping server (SIGTERM, `docker stop`) is not held for a load it cannot interrupt:
    stop returns while the factory still runs, and the loaded engine then serves nothing."""
    loading, release, loaded = threading.Event(), threading.Event(), threading.Event()

    def factory():
        loading.set()
        release.wait(20)  # a stop that waited for the load would return only after this
        loaded.set()
        return FakeEngine(max_num_seqs=1)

    sched = EngineBridge(factory)
    sched.start()
    assert loading.wait(10)
    sched.stop(timeout=30)
    stopped_while_loading = not loaded.is_set()
    release.set()
    assert stopped_while_loading
    assert sched._thread is not None
    sched._thread.join(10)
    assert not sched._thread.is_alive()
    assert not sched.wait_ready(0)  # stopped while loading stays stopped


class KVBoundEngine(FakeEngine):
    """A fake engine whose rows hold KV: one unit per prompt token, ``bound`` in all; a
    request starts when its prompt fits beside the running ones' (or alone)."""

    def __init__(self, bound: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.bound = bound

    def has_room_for(self, request: GenerationRequest) -> bool:
        held = sum(len(s.request.prompt_ids) for s in self.running)
        return self.has_room and (not self.running or held + len(request.prompt_ids) <= self.bound)


def test_a_request_whose_kv_does_not_fit_waits_first_in_line():
    # "big-prompt" (10 units) does not fit beside "first" (5); "tiny" (4) would, but waits
    # behind "big-prompt" (first come, first served: a big prompt is not passed forever),
    # then joins it.
    engine = KVBoundEngine(bound=14, max_num_seqs=4, token_delay=0.002)
    sched = EngineBridge.from_engine(engine, max_queue=16)
    sched.start()
    names = ("first", "big-prompt", "tiny")

    async def main():
        tickets = [sched.submit(_request(name, max_tokens=6)) for name in names]
        return await asyncio.gather(*(_collect(t) for t in tickets))

    try:
        results = asyncio.run(main())
    finally:
        sched.stop()
    assert [label for kind, label in engine.log if kind == "start"] == list(names)
    assert engine.max_concurrent == 2  # "big-prompt" and "tiny" together, never all three
    for name, (text, _) in zip(names, results, strict=True):
        assert text == engine.expected_text(_request(name, max_tokens=6))
