"""The engine end to end on fixture checkpoints: greedy speculative output equals plain
decoding for every drafter and depth, seeded determinism, stop conditions, bad input."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mtplx import engine_state, speculative
from mtplx.engine import Engine
from mtplx.models import load, make_layer_skip_draft, slot_store
from mtplx.planner import FILTERED, SAMPLED, StepCosts
from mtplx.planner import GREEDY as GREEDY_KIND
from mtplx.request import FinishEvent, GenerationRequest, SamplerConfig, TokenEvent
from mtplx.sequence import Status
from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.variants import quantize_checkpoint, untie_lm_head

GREEDY = SamplerConfig(temperature=0.0)
NUM_PROMPTS = 20
NUM_TOKENS = 128


def _prompts(vocab_size: int, count: int) -> list[list[int]]:
    """Deterministic prompts of varied length and content, some with repeats for n-gram."""
    prompts = []
    for i in range(count):
        length = 3 + (i * 7) % 29
        prompt = [(17 * i + 31 * j * j + 5) % (vocab_size - 3) + 3 for j in range(length)]
        if i % 3 == 0:
            prompt = prompt + prompt[: length // 2]
        prompts.append(prompt)
    return prompts


def generate(engine: Engine, request: GenerationRequest) -> tuple[list[int], FinishEvent]:
    """All token ids of a generation and its finish event."""
    tokens, finish = [], None
    for event in engine.generate(request):
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
        else:
            finish = event
    assert finish is not None
    return tokens, finish


def run_concurrently(engine: Engine, requests: list[GenerationRequest]) -> list[tuple[int, ...]]:
    """Each request's tokens: the requests run through one engine, ``engine.max_num_seqs``
    at a time, each joining as soon as a row is free. A greedy request, or a seeded one at
    a fixed depth, emits the tokens it emits alone (batch invariance), in far fewer engine
    steps than one request at a time."""
    tokens: list[list[int]] = [[] for _ in requests]
    waiting = list(reversed(range(len(requests))))
    while waiting or engine.running:
        while waiting and engine.has_room:
            index = waiting.pop()
            engine.add(requests[index], tag=index)
        for sequence, event in engine.step():
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, TokenEvent):
                tokens[sequence.tag].append(event.token_id)
    return [tuple(generated) for generated in tokens]


LLAMA_LIKE_KINDS = ("llama_mtp", "llama_no_mtp")


def load_fixture(kind: str, directory: Path) -> Engine:
    """Build the fixture checkpoint ``kind`` and an engine; llama-like trunks get an untied
    LM head (real spread in their next-token distributions) and a 1-layer layer-skip draft.
    A ``_q4`` suffix quantizes the trunk (products on the invariant quantized kernel)."""
    quantized = kind.endswith("_q4")  # the trunk quantized: 4-bit affine, group 32
    kind = kind.removesuffix("_q4")
    build_checkpoint(kind, directory)
    if kind in LLAMA_LIKE_KINDS:
        untie_lm_head(directory)
    if quantized:
        quantize_checkpoint(directory, bits=4, group_size=32)
    model = load(directory)
    draft = make_layer_skip_draft(model, 1) if kind in LLAMA_LIKE_KINDS else None
    return Engine(model, draft_model=draft)


@pytest.fixture(scope="module")
def llama_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return load_fixture("llama_mtp", tmp_path_factory.mktemp("llama_mtp"))


def _assert_greedy_equal(
    engine: Engine,
    num_prompts: int,
    num_tokens: int,
    depths,
    rotate: bool = False,
    together: bool = False,
) -> None:
    """Every available drafter at every depth emits plain greedy decoding's tokens (plain
    decoding alone is the reference). With ``rotate``, prompt i is checked at depth
    depths[i % len(depths)] only. With ``together``, the whole cross product runs
    ``engine.max_num_seqs`` requests at a time (rows of every drafter, depth and prompt side
    by side), and prompt i also runs alone with drafter i % len(drafters) at depth
    depths[i % len(depths)]: with 20 prompts every (drafter, depth) pair runs alone once."""
    prompts = _prompts(engine.vocab_size, num_prompts)
    plain = {}
    for index, prompt in enumerate(prompts):
        request = GenerationRequest(
            prompt, GREEDY, max_tokens=num_tokens, drafter="none", ignore_eos=True
        )
        plain[index], finish = generate(engine, request)
        assert len(plain[index]) == num_tokens and finish.finish_reason == "length"
    assert len({tuple(tokens) for tokens in plain.values()}) > num_prompts // 2  # not degenerate
    names = ("mtp", "draft_model", "ngram", "mtp+ngram", "draft_model+ngram")
    drafters = [d for d in names if d in engine.available_drafters]
    assert "mtp" in drafters
    cases = [
        (drafter, depth, index)
        for drafter in drafters
        for depth in depths
        for index in range(len(prompts))
        if not rotate or depths[index % len(depths)] == depth
    ]
    if together:
        alone = {
            (drafters[index % len(drafters)], depths[index % len(depths)], index)
            for index in range(len(prompts))
        }
    else:
        alone = set(cases)
    requests = [
        GenerationRequest(
            prompts[index],
            GREEDY,
            max_tokens=num_tokens,
            drafter=drafter,
            depth=depth,
            ignore_eos=True,
        )
        for drafter, depth, index in cases
    ]
    for case, request in zip(cases, requests, strict=True):
        if case in alone:
            tokens, _ = generate(engine, request)
            assert tokens == plain[case[2]], case
    if together:
        for case, tokens in zip(cases, run_concurrently(engine, requests), strict=True):
            assert list(tokens) == plain[case[2]], case


def test_greedy_speculative_equals_plain_llama(llama_engine: Engine) -> None:
    """20 prompts x 128 tokens for every drafter; prompt i drafts at depth 1 + i % 4, so
    every depth is covered (the full cross product runs in make test-slow)."""
    _assert_greedy_equal(llama_engine, NUM_PROMPTS, NUM_TOKENS, depths=(1, 2, 3, 4), rotate=True)


@pytest.mark.slow
def test_greedy_speculative_equals_plain_llama_every_depth(llama_engine: Engine) -> None:
    _assert_greedy_equal(llama_engine, NUM_PROMPTS, NUM_TOKENS, (1, 2, 3, 4), together=True)


def test_greedy_adaptive_depth_equals_plain_llama(llama_engine: Engine) -> None:
    _assert_greedy_equal(llama_engine, num_prompts=6, num_tokens=64, depths=(None,))


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5", "deepseek_v3", "deepseek_v4"])
def test_greedy_speculative_equals_plain_other_families(
    kind: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    engine = load_fixture(kind, tmp_path_factory.mktemp(kind))
    _assert_greedy_equal(engine, num_prompts=3, num_tokens=40, depths=(1, 3))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5", "deepseek_v3", "deepseek_v4"])
def test_greedy_speculative_equals_plain_other_families_full(
    kind: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # One request at a time: these families run one forward per row, and their rows side
    # by side take more CPU than one at a time (packed llama rows take less: above).
    engine = load_fixture(kind, tmp_path_factory.mktemp(kind))
    _assert_greedy_equal(engine, NUM_PROMPTS, NUM_TOKENS, depths=(1, 2, 3, 4))


def test_the_engine_prices_mtp_cycles_as_running_ahead(llama_engine: Engine) -> None:
    """The fixture's MTP head runs its cycles one step ahead, its layer-skip draft model
    does not: only the MTP source is priced without the synchronous step's extra."""
    assert llama_engine.costs.ahead == ("mtp",)


@pytest.mark.parametrize("depth", [1, 3])
def test_mtp_cycles_one_step_ahead_draw_what_cycles_in_step_draw(
    llama_engine: Engine, depth: int
) -> None:
    """MTP drafting cycles run one step ahead (the next cycle is built on the lazy verdict);
    a seeded request then emits the same tokens as when every cycle reads its verdict before
    the next is built, up to its last 2 (k + 1): there a cycle planned ahead must leave room
    for what the queued one may still commit, so its depth (and draws) may differ."""
    config = SamplerConfig(temperature=0.9, top_p=0.95, seed=4321)
    request = GenerationRequest(
        [5, 6, 7, 8, 9], config, max_tokens=48, drafter="mtp", depth=depth, ignore_eos=True
    )
    runs = []
    ahead_steps = 0
    for lazily in (True, False):
        llama_engine.batched.trims_lazily = lazily  # type: ignore[attr-defined]
        try:
            sequence = llama_engine.add(request)
            tokens = []
            while not sequence.finished:
                for _, event in llama_engine.step():
                    assert isinstance(event, TokenEvent | FinishEvent)
                    if isinstance(event, TokenEvent):
                        tokens.append(event.token_id)
                ahead_steps += lazily and sequence in llama_engine.in_flight.drafts
            runs.append((tokens, sequence.stats.accepted_per_position))
        finally:
            del llama_engine.batched.trims_lazily  # type: ignore[attr-defined]
    assert ahead_steps > 10  # the cycles really ran ahead
    (ahead, ahead_accepted), (in_step, _) = runs
    assert len(ahead) == len(in_step) == 48
    assert ahead[: 48 - 2 * (depth + 1)] == in_step[: 48 - 2 * (depth + 1)]
    assert sum(ahead_accepted) > 0  # drafts were accepted, so lengths varied


def test_closing_a_queued_cycle_reads_only_what_its_evaluation_computed(
    llama_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing a drafting cycle queued one step ahead reads arrays the cycle's own
    ``async_eval`` was given (its verdict, its committed tokens, the row's lazy trim), never
    an array derived from them: that one would be computed after the cycle queued since,
    and reading it would hold the host until that whole cycle was done."""
    evaluated: set[int] = set()
    reads: list[bool] = []
    closing = [False]
    real_async_eval = mx.async_eval

    def async_eval(*args: Any) -> None:
        evaluated.update(id(a) for _, a in tree_flatten(list(args)) if isinstance(a, mx.array))
        real_async_eval(*args)

    def reader(real: Any) -> Any:
        def read(array: mx.array) -> Any:
            if closing[0]:
                reads.append(id(array) in evaluated)
            return real(array)

        return read

    def close(*args: Any) -> Any:
        closing[0] = True
        try:
            return real_close(*args)
        finally:
            closing[0] = False

    real_close = engine_state.close_queued
    monkeypatch.setattr(mx, "async_eval", async_eval)
    monkeypatch.setattr(engine_state, "close_queued", close)
    for module in (speculative, slot_store):
        monkeypatch.setattr(module, "scalar_int", reader(module.scalar_int))
    monkeypatch.setattr(speculative, "int_rows", reader(speculative.int_rows))
    request = GenerationRequest(
        [5, 6, 7, 8, 9], SamplerConfig(temperature=0.0), max_tokens=24, drafter="mtp", depth=1
    )
    generate(llama_engine, request)
    assert len(reads) > 20 and all(reads), reads


@pytest.mark.parametrize("drafter", ["none", "mtp", "draft_model", "ngram", "mtp+ngram"])
def test_same_seed_same_output(llama_engine: Engine, drafter: str) -> None:
    config = SamplerConfig(temperature=0.9, top_p=0.95, seed=1234)
    request = GenerationRequest([5, 6, 7, 5, 6], config, max_tokens=40, drafter=drafter, depth=3)
    first, _ = generate(llama_engine, request)
    second, _ = generate(llama_engine, request)
    assert first == second
    other = GenerationRequest(
        [5, 6, 7, 5, 6],
        SamplerConfig(temperature=0.9, top_p=0.95, seed=99),
        max_tokens=40,
        drafter=drafter,
        depth=3,
    )
    assert generate(llama_engine, other)[0] != first


def test_max_tokens_and_stats(llama_engine: Engine) -> None:
    request = GenerationRequest([9, 8, 7], GREEDY, max_tokens=17, drafter="ngram", depth=4)
    tokens, finish = generate(llama_engine, request)
    assert len(tokens) == 17 and finish.finish_reason == "length"
    stats = finish.stats
    assert stats.completion_tokens == 17 and stats.prompt_tokens == 3
    assert sum(stats.drafted_per_position) == stats.num_draft_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert stats.num_recovered + stats.num_bonus == stats.num_drafts


def test_stop_token_ids_end_generation_without_emitting_it(llama_engine: Engine) -> None:
    prompt = [11, 12, 13, 14]
    tokens, _ = generate(llama_engine, GenerationRequest(prompt, GREEDY, max_tokens=30))
    stop_token = tokens[5]
    first = tokens.index(stop_token)
    request = GenerationRequest(prompt, GREEDY, max_tokens=30, stop_token_ids=[stop_token])
    stopped, finish = generate(llama_engine, request)
    assert stopped == tokens[:first] and finish.finish_reason == "stop"


def _streamed_text(engine: Engine, request: GenerationRequest) -> tuple[str, FinishEvent]:
    pieces, finish = [], None
    for event in engine.generate(request):
        if isinstance(event, TokenEvent):
            pieces.append(event.text)
        else:
            finish = event
    return "".join(pieces) + finish.text, finish


def test_stop_string_ends_generation_and_is_not_emitted(llama_engine: Engine) -> None:
    prompt = [21, 22, 23, 24, 25]
    request = GenerationRequest(prompt, GREEDY, max_tokens=40, ignore_eos=True)
    full_text, _ = _streamed_text(llama_engine, request)
    middle = len(full_text) // 2
    stop = full_text[middle : middle + 3]
    assert len(stop) == 3
    for drafter in ("none", "ngram", "mtp", "draft_model", "mtp+ngram"):
        stopped = GenerationRequest(
            prompt, GREEDY, max_tokens=40, stop=[stop], drafter=drafter, depth=3, ignore_eos=True
        )
        text, finish = _streamed_text(llama_engine, stopped)
        assert finish.finish_reason == "stop" and finish.stop_sequence == stop
        assert text == full_text[: full_text.index(stop)]
    _, finish = _streamed_text(llama_engine, request)
    assert finish.finish_reason == "length" and finish.stop_sequence is None


def test_logprobs_are_reported_for_every_token(llama_engine: Engine) -> None:
    request = GenerationRequest([3, 4, 5], GREEDY, max_tokens=8, logprobs=3, drafter="ngram")
    events = [e for e in llama_engine.generate(request) if isinstance(e, TokenEvent)]
    for event in events:
        assert event.logprob is not None and event.logprob <= 0
        assert len(event.top_logprobs) == 3
        assert event.top_logprobs[0][0] == event.token_id  # greedy picks the most likely
        assert event.top_logprobs[0][1] == pytest.approx(event.logprob)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"drafter": "medusa"}, "drafter"),
        ({"depth": 99}, "depth"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"prompt_ids": []}, "prompt"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_bad_requests_are_rejected_by_name(kwargs: dict, field: str) -> None:
    arguments = {"prompt_ids": [1, 2, 3], **kwargs}
    with pytest.raises(ValueError, match=field):
        GenerationRequest(**arguments)


def test_engine_rejects_before_work_and_stays_usable(llama_engine: Engine) -> None:
    too_long = [5] * llama_engine.context_length
    with pytest.raises(ValueError, match="context length"):
        next(llama_engine.generate(GenerationRequest(too_long, GREEDY)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        next(llama_engine.generate(GenerationRequest([llama_engine.vocab_size + 5], GREEDY)))
    tokens, _ = generate(llama_engine, GenerationRequest([1, 2, 3], GREEDY, max_tokens=5))
    assert len(tokens) == 5


def test_drafter_unavailable_without_mtp_heads(tmp_path: Path) -> None:
    build_checkpoint("llama_no_mtp", tmp_path)
    engine = Engine(load(tmp_path))
    assert "mtp" not in engine.available_drafters and engine.default_drafter == "ngram"
    with pytest.raises(ValueError, match="drafter 'mtp' is not available"):
        engine.validate(GenerationRequest([1, 2], GREEDY, drafter="mtp"))


def test_draft_model_with_another_vocabulary_is_rejected(
    llama_engine: Engine, tmp_path: Path
) -> None:
    class OtherVocab:
        vocab_size = llama_engine.vocab_size + 1
        hidden_size = 8

    with pytest.raises(ValueError, match="vocabulary"):
        Engine(llama_engine.model, draft_model=OtherVocab())  # type: ignore[arg-type]


def test_generation_can_be_cancelled_between_cycles(llama_engine: Engine) -> None:
    stream = llama_engine.generate(GenerationRequest([1, 2, 3], GREEDY, max_tokens=100))
    first = next(stream)
    assert isinstance(first, TokenEvent)
    stream.close()
    tokens, _ = generate(llama_engine, GenerationRequest([1, 2, 3], GREEDY, max_tokens=4))
    assert len(tokens) == 4


@pytest.mark.parametrize("drafter", ["none", "mtp", "ngram"])
def test_a_sequence_moves_through_its_statuses_and_leaves_nothing_in_flight(
    llama_engine: Engine, drafter: str
) -> None:
    """A request is prefilling until its first token, then running, then finished; its
    work one step ahead is the batch's (plain forwards queued, MTP cycles run ahead), and
    none of it is left once the batch has drained, finished or cancelled."""
    long = GenerationRequest(
        list(range(3, 40)), GREEDY, max_tokens=24, drafter=drafter, ignore_eos=True
    )
    sequence = llama_engine.add(long)
    cancelled = llama_engine.add(long)
    seen = []
    in_flight_steps = 0
    while llama_engine.running:
        seen.append(sequence.status)
        if len(seen) == 6:
            llama_engine.abort(cancelled)
            assert cancelled.status is Status.FINISHED and cancelled not in llama_engine.in_flight
        for _, event in llama_engine.step():
            assert not isinstance(event, BaseException)
        in_flight_steps += sequence in llama_engine.in_flight
    assert sequence.status is Status.FINISHED and not sequence.failed
    assert seen[0] is Status.PREFILLING and Status.RUNNING in seen
    assert seen == sorted(seen, key=[Status.PREFILLING, Status.RUNNING].index)
    assert in_flight_steps > 5  # its plain forwards or drafting cycles ran one step ahead
    in_flight = llama_engine.in_flight
    assert not (in_flight.plain or in_flight.drafts or in_flight.planned or in_flight.committed)


def test_reduced_draft_vocabulary_keeps_greedy_exact(llama_draft_vocab_checkpoint: Path) -> None:
    """A head drafting over 128 of the 259 tokens: q is zero outside them, output unchanged."""
    model = load(llama_draft_vocab_checkpoint)
    assert model.draft_vocab is not None and model.draft_vocab.shape[0] < model.target.vocab_size
    engine = Engine(model)
    for prompt in _prompts(engine.vocab_size, 4):
        plain, _ = generate(engine, GenerationRequest(prompt, GREEDY, 48, drafter="none"))
        for depth in (1, 3):
            request = GenerationRequest(prompt, GREEDY, 48, drafter="mtp", depth=depth)
            assert generate(engine, request)[0] == plain


ENGINE_MODULES = (
    "engine",
    "engine_state",
    "admission",
    "schedule",
    "runner",
    "postprocess",
    "prefill",
    "speculative",
    "step",
)


def test_the_step_reads_in_short_functions() -> None:
    # The step's schedule, run and postprocess stay readable: no function of the engine's
    # modules over 60 lines (docstring included), and the step on one screen.
    import mtplx

    root = Path(mtplx.__file__).parent
    long = []
    for name in ENGINE_MODULES:
        tree = ast.parse((root / f"{name}.py").read_text())
        long += [
            f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 60
        ]
    assert long == []
    step = next(
        node
        for node in ast.walk(ast.parse((root / "engine.py").read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "step"
    )
    assert step.end_lineno - step.lineno + 1 <= 20  # one screen, top to bottom


def test_each_row_is_planned_at_the_prices_of_its_own_sampling_kind(tmp_path: Path) -> None:
    # A greedy cycle free, a sampled or filtered one 100 plain steps: in one batch the greedy
    # row drafts from the head and the sampled rows never do (no probe pays either), each
    # row's depth policy priced by its own kind. Pricing every row as greedy drafted at
    # T > 0 where the sampled verdict made the cycle cost ~1.7 plain steps.
    build_checkpoint("llama_mtp", tmp_path)
    dear = [0.0] + [1.0] * 5
    costs = StepCosts(
        [1, 4],
        [0.01, 0.04],
        [0.001, 0.004],
        [0.0, 0.0],
        drafting={"mtp": [0.0] + [-1.0] * 5},
        sampled={"mtp": dear, "ngram": dear},
        filtered={"mtp": dear, "ngram": dear},
    )
    engine = Engine(load(tmp_path), costs=costs)
    prompt = _prompts(engine.vocab_size, 1)[0]
    samplers = {
        GREEDY_KIND: GREEDY,
        SAMPLED: SamplerConfig(temperature=0.8, seed=1),
        FILTERED: SamplerConfig(temperature=0.8, top_p=0.9, seed=2),
    }
    rows = {
        kind: engine.add(
            GenerationRequest(prompt_ids=prompt, sampler=sampler, max_tokens=24, drafter="mtp")
        )
        for kind, sampler in samplers.items()
    }
    for kind, row in rows.items():
        priced = engine.costs.row_costs("mtp", 1, engine.max_adaptive_depth, kind)
        assert row.policies["mtp"].cycle_cost == pytest.approx(priced)
    while engine.running:
        engine.step()
    drafted = {kind: row.stats.num_draft_tokens for kind, row in rows.items()}
    assert drafted[GREEDY_KIND] > 0 and drafted[SAMPLED] == drafted[FILTERED] == 0
