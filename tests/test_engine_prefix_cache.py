"""The prefix cache in the engine: a request that reuses cached blocks gives what it gives on
a cold engine (greedy and seeded, every drafter, drafting resuming at once), the cached
states are bitwise those of a cold prefill, prompts sharing a prefix feed it once, and the
cache stays within its budget."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtplx.engine import Engine
from mtplx.models import load, make_layer_skip_draft
from mtplx.models.slot_store import IDLE_CAPACITY
from mtplx.models.slot_target import SlotTarget
from mtplx.prefix_cache import BLOCK_SIZE
from mtplx.request import FinishEvent, GenerationRequest, GenerationStats, SamplerConfig, TokenEvent
from mtplx.sequence import Sequence
from tests.fixtures.checkpoints import build_checkpoint
from tests.test_engine import load_fixture
from tests.test_engine_batching import run_batch

GREEDY = SamplerConfig(temperature=0.0)
SEEDED = SamplerConfig(temperature=0.9, seed=11)


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return load_fixture("llama_mtp", tmp_path_factory.mktemp("llama_mtp"))


def _cached_engine(cold: Engine, max_bytes: int = 1 << 28) -> Engine:
    """An engine over the same weights as ``cold``, with a prefix cache."""
    return Engine(
        cold.model,
        draft_model=make_layer_skip_draft(cold.model, 1),
        prefix_cache_bytes=max_bytes,
    )


def _run(engine: Engine, request: GenerationRequest) -> tuple[list[int], GenerationStats]:
    tokens, stats = [], None
    for event in engine.generate(request):
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
        elif isinstance(event, FinishEvent):
            stats = event.stats
    assert stats is not None
    return tokens, stats


def _prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, vocab_size, length)]


def test_a_cache_hit_after_the_idle_store_was_freed_gives_the_cold_output(cold: Engine) -> None:
    """A long request grows the slot store past IDLE_CAPACITY and leaves the engine idle, so
    the store is freed; the next request's cache hit loads its blocks into a store allocated
    afresh (every layer its own array: they are written in place)."""
    cached = _cached_engine(cold)
    assert isinstance(cached.batched, SlotTarget)
    prompt = _prompt(21, 2 * BLOCK_SIZE + 3, cold.vocab_size)
    request = GenerationRequest(prompt, GREEDY, 16)
    expected, _ = _run(cold, request)
    assert _run(cached, request)[0] == expected  # caches the prompt's blocks
    long_prompt = _prompt(22, IDLE_CAPACITY + 40, cold.vocab_size)
    _run(cached, GenerationRequest(long_prompt, GREEDY, 1))
    assert cached.batched._shared.capacity == 0  # freed when that request left
    got, stats = _run(cached, request)
    assert stats.cached_tokens >= 2 * BLOCK_SIZE
    assert got == expected


@pytest.mark.parametrize("config", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_cache_hit_gives_the_cold_output_for_every_drafter(
    cold: Engine, config: SamplerConfig
) -> None:
    cached = _cached_engine(cold)
    system = _prompt(1, 3 * BLOCK_SIZE + 5, cold.vocab_size)
    _run(cached, GenerationRequest([*system, 3], config, 1))  # caches the system prompt
    for drafter in cold.available_drafters:
        depth = None if drafter == "none" else 2
        turn = [*system, *_prompt(hash(drafter) % 1000, 7, cold.vocab_size)]
        for _ in range(3):  # a conversation: each turn's prompt holds the last reply
            request = GenerationRequest(turn, config, 24, drafter=drafter, depth=depth)
            expected, expected_stats = _run(cold, request)
            got, stats = _run(cached, request)
            assert got == expected, drafter
            # Drafting resumes right after the hit: the same drafts are accepted.
            assert stats.accepted_per_position == expected_stats.accepted_per_position
            assert stats.cached_tokens >= 3 * BLOCK_SIZE
            turn = [*turn, *got, *_prompt(len(turn), 5, cold.vocab_size)]
        # The reply's blocks were cached too: the next turn reused more than the prompt.
        assert stats.cached_tokens > len(system)


def test_cached_states_are_bitwise_those_of_a_cold_prefill(cold: Engine) -> None:
    cached = _cached_engine(cold)
    prompt = _prompt(2, 5 * BLOCK_SIZE + 3, cold.vocab_size)
    request = GenerationRequest(prompt, GREEDY, 3 * BLOCK_SIZE, drafter="mtp", depth=3)
    output, _ = _run(cached, request)  # prompt + reply (drafted, verified) are cached
    tokens = [*prompt, *output]
    slots = cached.batched
    assert isinstance(slots, SlotTarget)
    row = slots.new_row()
    for start in range(0, len(tokens) - 1, 7):  # a cold prefill, in other chunks
        chunk = mx.array(tokens[start : min(start + 7, len(tokens) - 1)], mx.int32)
        mx.eval(slots.forward([row], [chunk], "none")[0].hidden, slots.unevaluated())
    blocks = cached.prefix_cache.match(tokens)  # type: ignore[union-attr]
    assert len(blocks) == (len(tokens) - 1) // BLOCK_SIZE
    for index, block in enumerate(blocks):
        fresh = slots.save_block(row, index * BLOCK_SIZE, (index + 1) * BLOCK_SIZE)
        for name in ("keys", "values", "hidden"):
            assert np.array_equal(
                np.array(getattr(block.state, name)), np.array(getattr(fresh, name))
            ), (index, name)
    slots.release(row)


def test_prompts_sharing_a_prefix_feed_it_once(cold: Engine) -> None:
    cached = _cached_engine(cold)
    system = _prompt(3, 6 * BLOCK_SIZE, cold.vocab_size)
    requests = [
        GenerationRequest(
            [*system, *_prompt(100 + i, 3 + i, cold.vocab_size)], GREEDY, 12, drafter="none"
        )
        for i in range(5)
    ]
    expected = [_run(cold, request)[0] for request in requests]
    got, last = run_batch(cached, requests)  # all admitted in the same step
    assert got == expected
    cached_tokens = [event.stats.cached_tokens for event in last]  # type: ignore[attr-defined]
    # The first feeds the shared blocks; the others copy them as they are cached.
    assert cached_tokens[0] == 0 and all(n == len(system) for n in cached_tokens[1:])


def test_the_cache_stays_within_its_budget(cold: Engine) -> None:
    block_bytes = 0
    probe = _cached_engine(cold)
    _run(probe, GenerationRequest(_prompt(4, BLOCK_SIZE + 1, cold.vocab_size), GREEDY, 1))
    block_bytes = probe.prefix_cache.stats.num_bytes  # type: ignore[union-attr]
    assert block_bytes > 0
    budget = 10 * block_bytes
    cached = _cached_engine(cold, budget)
    stats = cached.prefix_cache.stats  # type: ignore[union-attr]
    for seed in range(12):
        prompt = _prompt(1000 + seed, 3 * BLOCK_SIZE + 2, cold.vocab_size)
        _run(cached, GenerationRequest(prompt, GREEDY, 4, drafter="none"))
        assert stats.num_bytes <= budget
    assert stats.evictions > 0 and stats.num_blocks == stats.num_bytes // block_bytes
    # The most recent prompt is still served from the cache.
    _, hit = _run(cached, GenerationRequest(prompt, GREEDY, 4, drafter="none"))
    assert hit.cached_tokens == 3 * BLOCK_SIZE


def test_a_failed_row_is_not_cached(cold: Engine) -> None:
    cached = _cached_engine(cold)
    prompt = _prompt(5, 2 * BLOCK_SIZE + 1, cold.vocab_size)
    sequence = cached.add(GenerationRequest(prompt, GREEDY, 2 * BLOCK_SIZE, drafter="mtp", depth=2))
    while not sequence.prefilled:
        cached.step()
    blocks_after_prompt = cached.prefix_cache.stats.num_blocks  # type: ignore[union-attr]

    def commit(*args: object) -> None:
        raise RuntimeError("drafter exploded")

    sequence.drafter.commit = commit  # type: ignore[union-attr, method-assign]
    while cached.running:
        cached.step()
    assert sequence.failed
    assert cached.prefix_cache.stats.num_blocks == blocks_after_prompt  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["qwen3_next", "deepseek_v3"])
def test_one_forward_per_row_families_resume_at_prompt_chunks(kind: str, tmp_path: Path) -> None:
    """Hybrid recurrent (gated delta) and MLA models: prompt states are cached at prefill
    chunk ends (recurrent state snapshotted there) and a hit gives the cold output."""
    build_checkpoint(kind, tmp_path)
    model = load(tmp_path)
    cold = Engine(model)
    cached = Engine(model, prefix_cache_bytes=1 << 26)
    assert cached.prefix is not None and not cached.prefix.caches_replies
    chunk = cached.prefill_chunk_size
    system = _prompt(6, 2 * chunk + 9, model.target.vocab_size)
    runs = [("none", GREEDY), ("mtp", GREEDY), ("mtp", SEEDED), ("ngram", SEEDED)]
    for index, (drafter, config) in enumerate(runs):
        depth = None if drafter == "none" else 2
        prompt = [*system, *_prompt(10 + index, 5, model.target.vocab_size)]
        request = GenerationRequest(prompt, config, 16, drafter=drafter, depth=depth)
        expected, expected_stats = _run(cold, request)
        got, stats = _run(cached, request)
        assert got == expected, (drafter, config)
        assert stats.accepted_per_position == expected_stats.accepted_per_position
    # Every request after the first resumed at the system prompt's last chunk end.
    assert stats.cached_tokens == 2 * chunk


def test_families_whose_caches_cannot_be_saved_run_without_a_cache(tmp_path: Path) -> None:
    build_checkpoint("deepseek_v4", tmp_path)
    engine = Engine(load(tmp_path), prefix_cache_bytes=1 << 20)
    assert engine.prefix_cache is None
    tokens, stats = _run(engine, GenerationRequest([5, 6, 7, 8], GREEDY, 4, ignore_eos=True))
    assert len(tokens) == 4 and stats.cached_tokens == 0


def test_lookups_count_blocks_copied_from_a_prompt_fed_beside(cold: Engine) -> None:
    cached = _cached_engine(cold)
    system = _prompt(6, 4 * BLOCK_SIZE, cold.vocab_size)
    requests = [
        GenerationRequest(
            [*system, *_prompt(200 + i, 3, cold.vocab_size)], GREEDY, 2, drafter="none"
        )
        for i in range(3)
    ]
    _, last = run_batch(cached, requests)  # the first feeds the blocks, the others copy them
    served = sum(event.stats.cached_tokens for event in last)  # type: ignore[attr-defined]
    assert served == 2 * len(system)
    stats = cached.prefix_cache.stats  # type: ignore[union-attr]
    # /metrics agrees with the replies' usage: two hits, one miss.
    assert (stats.hits, stats.misses, stats.hit_tokens) == (2, 1, served)


def test_calibration_leaves_no_blocks_nor_counts(
    cold: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mtplx import calibration
    from mtplx.engine import DEFAULT_COSTS

    cached = _cached_engine(cold)

    def calibrate(engine: Engine) -> object:  # scratch prompts through the engine
        for _ in range(2):
            _run(
                engine,
                GenerationRequest(_prompt(7, 2 * BLOCK_SIZE + 1, cold.vocab_size), GREEDY, 2),
            )
        return DEFAULT_COSTS

    monkeypatch.setattr(calibration, "load_or_calibrate", calibrate)
    cached.warm_up()
    stats = cached.prefix_cache.stats  # type: ignore[union-attr]
    assert (stats.num_blocks, stats.num_bytes) == (0, 0)
    # /metrics starts from zero: calibration's lookups are not the server's.
    assert (stats.hits, stats.misses, stats.hit_tokens, stats.evictions) == (0, 0, 0, 0)


def test_a_failed_load_of_cached_blocks_leaves_no_row_behind(cold: Engine) -> None:
    cached = _cached_engine(cold)
    prompt = _prompt(8, 2 * BLOCK_SIZE + 1, cold.vocab_size)
    _run(cached, GenerationRequest(prompt, GREEDY, 1, drafter="none"))

    def load_blocks(*args: object) -> None:
        raise RuntimeError("out of memory")

    cached.batched.load_blocks = load_blocks  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        cached.add(GenerationRequest(prompt, GREEDY, 1, drafter="none"))
    # The scheduler fails the request; no sequence stays in the batch holding a slot.
    assert cached.running == []
    assert len(cached.batched._free) == cached.max_num_seqs  # type: ignore[attr-defined]


def test_a_failure_to_cache_a_finished_reply_fails_no_other_row(cold: Engine) -> None:
    cached = _cached_engine(cold)
    short = GenerationRequest(
        _prompt(9, BLOCK_SIZE - 1, cold.vocab_size), GREEDY, 4, drafter="none"
    )
    long = GenerationRequest(_prompt(10, 5, cold.vocab_size), GREEDY, 40, drafter="none")
    expected = _run(cold, long)[0]

    def save_block(*args: object) -> None:
        raise RuntimeError("out of memory")

    cached.batched.save_block = save_block  # type: ignore[method-assign]
    got, last = run_batch(cached, [short, long])  # the short one's reply: a whole block
    assert all(isinstance(event, FinishEvent) for event in last)
    assert got[1] == expected


def _first_token_steps(engine: Engine, requests: list[GenerationRequest]) -> list[int]:
    """The step at which each request (all admitted together) had its first token."""
    first: dict[int, int] = {}

    def on_step(step: int, rows: dict) -> None:
        for index, sequence in rows.items():
            if sequence.prefilled and index not in first:
                first[index] = step

    run_batch(engine, requests, on_step=on_step)
    return [first[index] for index in range(len(requests))]


@pytest.mark.parametrize("blocks", [0, 2], ids=["nothing", "two_blocks"])
def test_prompts_do_not_wait_for_blocks_the_budget_cannot_keep(cold: Engine, blocks: int) -> None:
    probe = _cached_engine(cold)
    _run(probe, GenerationRequest(_prompt(4, BLOCK_SIZE + 1, cold.vocab_size), GREEDY, 1))
    block_bytes = probe.prefix_cache.stats.num_bytes  # type: ignore[union-attr]
    system = _prompt(11, 12 * BLOCK_SIZE, cold.vocab_size)
    requests = [
        GenerationRequest(
            [*system, *_prompt(300 + i, 3, cold.vocab_size)], GREEDY, 2, drafter="none"
        )
        for i in range(4)
    ]
    cached = _cached_engine(cold, max(blocks * block_bytes, 1))  # less than the shared prompt
    assert cached.prefix_cache.block_bytes == block_bytes  # type: ignore[union-attr]
    if blocks == 0:  # nothing to wait for: the steps of an engine without the cache
        assert _first_token_steps(cached, requests) == _first_token_steps(
            Engine(cold.model), requests
        )
        return
    # The first prompt goes alone while the others wait for the blocks the budget keeps;
    # they copy them, then feed the rest side by side. Waiting for blocks the budget evicts
    # at once would only delay them, each behind the one before it. (Counted in positions
    # fed, not in steps to a first token against an engine without the cache: there the
    # four prompts feed while nothing decodes, here the others feed beside the first one's
    # decoding, where their chunks are priced by their depth.)
    positions: list[list[int]] = []  # the others' prompt positions fed, step by step
    first: dict[int, int] = {}  # the step of each prompt's first token
    rows: dict[int, Sequence] = {}

    def on_step(step: int, running: dict[int, Sequence]) -> None:
        rows.update(running)
        positions.append([running[index].num_prefilled for index in (1, 2, 3)])
        for index, sequence in running.items():
            if sequence.prefilled:
                first.setdefault(index, step)

    run_batch(cached, requests, on_step=on_step)
    kept = blocks * BLOCK_SIZE
    assert [rows[index].stats.cached_tokens for index in (1, 2, 3)] == [kept] * 3
    assert first[0] < first[1] == first[2] == first[3]
    assert all(max(fed) - min(fed) < BLOCK_SIZE for fed in positions)
