"""Continuous batching: every row of a batch decodes exactly as it would alone.

Greedy output and seeded sampled output at a fixed depth are identical alone and in a
batch, whatever else runs beside a row (other drafters, depths and samplers, rows joining
and leaving); the output distribution of rows with different samplers in one batch is the
target's (chi-square against exact enumeration); a failing or cancelled row leaves the
others untouched."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mtplx.engine import Engine
from mtplx.models import load, make_layer_skip_draft
from mtplx.request import FinishEvent, GenerationRequest, SamplerConfig, TokenEvent
from mtplx.sequence import Sequence
from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.variants import untie_lm_head
from tests.test_engine import _prompts, generate, load_fixture
from tests.test_speculative import (
    NUM_GENERATED,
    SIGNIFICANCE,
    SMALL_VOCAB,
    _chi_square_pvalue,
    _exact_first_tokens,
)

GREEDY = SamplerConfig(temperature=0.0)


@pytest.fixture(
    scope="module", params=["llama_mtp", "llama_mtp_q4", "llama_mtp_q4_int8", "qwen3_next"]
)
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Each family's engine; ``_int8``: the quantized kernel with int8 activations (a process
    setting, held while the module's tests of that engine run)."""
    kind = request.param.removesuffix("_int8")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MTPLX_ACTIVATIONS", "int8" if request.param.endswith("_int8") else "float32")
        yield load_fixture(kind, tmp_path_factory.mktemp(request.param))


def _solo(engine: Engine, request: GenerationRequest) -> list[int]:
    return [e.token_id for e in engine.generate(request) if isinstance(e, TokenEvent)]


def run_batch(
    engine: Engine,
    requests: list[GenerationRequest],
    join_at: list[int] | None = None,
    on_step: Callable[[int, dict[int, Sequence]], None] | None = None,
) -> tuple[list[list[int]], list[object]]:
    """Run ``requests`` as one batch, request i joining at step ``join_at[i]``; returns each
    row's tokens and its last event (FinishEvent, or the exception that failed it)."""
    join_at = join_at or [0] * len(requests)
    tokens: list[list[int]] = [[] for _ in requests]
    last: list[object] = [None] * len(requests)
    rows: dict[int, Sequence] = {}
    step = 0
    while len(rows) < len(requests) or engine.running:
        for index, request in enumerate(requests):
            if join_at[index] == step:
                rows[index] = engine.add(request, tag=index)
        if on_step is not None:
            on_step(step, rows)
        for sequence, event in engine.step():
            if isinstance(event, TokenEvent):
                tokens[sequence.tag].append(event.token_id)
            else:
                last[sequence.tag] = event
        step += 1
    return tokens, last


def _mixed_requests(engine: Engine, config_for: Callable[[int], SamplerConfig]):
    names = [d for d in ("mtp", "draft_model", "ngram", "mtp+ngram", "none")]
    drafters = [d for d in names if d in engine.available_drafters]
    requests = []
    for index, prompt in enumerate(_prompts(engine.vocab_size, 7)):
        drafter = drafters[index % len(drafters)]
        depth = None if drafter == "mtp+ngram" else (0 if drafter == "none" else 1 + index % 4)
        requests.append(
            GenerationRequest(
                prompt, config_for(index), 40, drafter=drafter, depth=depth, ignore_eos=True
            )
        )
    return requests


def test_greedy_rows_in_a_batch_equal_their_solo_runs(engine: Engine) -> None:
    requests = _mixed_requests(engine, lambda _: GREEDY)
    solo = [_solo(engine, request) for request in requests]
    batched, last = run_batch(engine, requests, join_at=[0, 0, 1, 3, 3, 8, 20])
    assert all(isinstance(event, FinishEvent) for event in last)
    for index, (alone, together) in enumerate(zip(solo, batched, strict=True)):
        assert together == alone, (index, requests[index].drafter, requests[index].depth)


def test_seeded_rows_at_fixed_depths_equal_their_solo_runs(engine: Engine) -> None:
    configs = [
        SamplerConfig(temperature=0.8, seed=1),
        SamplerConfig(temperature=1.0, top_p=0.9, seed=2),
        SamplerConfig(temperature=0.7, top_k=5, seed=3),
        SamplerConfig(temperature=0.9, min_p=0.05, seed=4),
        SamplerConfig(temperature=0.8, repetition_penalty=1.2, seed=5),
        SamplerConfig(temperature=0.6, presence_penalty=0.5, seed=6),
        SamplerConfig(temperature=1.2, seed=7),
    ]
    requests = [
        GenerationRequest(
            r.prompt_ids, configs[i], 40, drafter=r.drafter, depth=r.depth or 0, ignore_eos=True
        )
        for i, r in enumerate(_mixed_requests(engine, lambda _: GREEDY))
    ]
    solo = [_solo(engine, request) for request in requests]
    batched, _ = run_batch(engine, requests, join_at=[0, 2, 2, 0, 5, 1, 9])
    assert batched == solo


def test_a_failing_row_fails_alone(engine: Engine) -> None:
    requests = _mixed_requests(engine, lambda _: GREEDY)[:4]
    solo = [_solo(engine, request) for request in requests]

    class Broken(RuntimeError):
        pass

    def break_row_one(step: int, rows: dict[int, Sequence]) -> None:
        if step == 4:

            def commit(*args: object) -> None:
                raise Broken("drafter exploded")

            rows[1].drafter.commit = commit  # type: ignore[union-attr, method-assign]

    batched, last = run_batch(engine, requests, on_step=break_row_one)
    assert isinstance(last[1], Broken)
    assert batched[1] == solo[1][: len(batched[1])] and len(batched[1]) < len(solo[1])
    for index in (0, 2, 3):
        assert batched[index] == solo[index] and isinstance(last[index], FinishEvent)
    assert not engine.running


def test_a_cancelled_row_leaves_the_batch_intact(engine: Engine) -> None:
    requests = _mixed_requests(engine, lambda _: GREEDY)[:4]
    solo = [_solo(engine, request) for request in requests]

    def cancel_row_two(step: int, rows: dict[int, Sequence]) -> None:
        if step == 6:
            engine.abort(rows[2])

    batched, last = run_batch(engine, requests, join_at=[0, 0, 0, 7], on_step=cancel_row_two)
    assert last[2] is None and batched[2] == solo[2][: len(batched[2])]
    for index in (0, 1, 3):
        assert batched[index] == solo[index]


NUM_RUNS = 1500


def test_rows_with_different_samplers_follow_plain_decoding(tmp_path: Path) -> None:
    """Three rows in every batch, each its own drafter, depth and sampler: each row's first
    tokens follow its own exact plain-decoding distribution."""
    build_checkpoint("llama_mtp", tmp_path)
    untie_lm_head(tmp_path, logit_scale=2.0, vocab_size=SMALL_VOCAB)
    model = load(tmp_path)
    engine = Engine(model, draft_model=make_layer_skip_draft(model, 1))
    rows = [
        ([1, 2, 3, 1, 2], "mtp", 2, SamplerConfig(temperature=0.8, top_k=6, top_p=0.9)),
        ([4, 5, 4, 5], "ngram", 2, SamplerConfig(temperature=0.7, frequency_penalty=0.8)),
        ([2, 7, 1], "draft_model", 1, SamplerConfig(temperature=1.0, min_p=0.05)),
        ([3, 3, 9], "none", 0, SamplerConfig(temperature=0.9)),
    ]
    observed: list[dict[tuple[int, ...], int]] = [{} for _ in rows]
    for run in range(NUM_RUNS):
        requests = [
            GenerationRequest(
                prompt,
                SamplerConfig(**{**config.__dict__, "seed": run * 7 + i}),
                max_tokens=NUM_GENERATED,
                drafter=drafter,
                depth=depth,
                ignore_eos=True,
            )
            for i, (prompt, drafter, depth, config) in enumerate(rows)
        ]
        tokens, _ = run_batch(engine, requests, join_at=[0, run % 2, 0, 1])
        for i, generated in enumerate(tokens):
            observed[i][tuple(generated)] = observed[i].get(tuple(generated), 0) + 1
    for i, (prompt, _, _, config) in enumerate(rows):
        exact = _exact_first_tokens(engine, prompt, config)
        assert _chi_square_pvalue(observed[i], exact, NUM_RUNS) > SIGNIFICANCE, rows[i][1:]


def test_a_short_prompt_behind_a_long_one_starts_at_once(engine: Engine) -> None:
    """Waiting prompts share a step's forward: a short prompt that arrives while a long one
    is being fed gets its first token within a step or two, not after the long one."""
    vocab = engine.vocab_size
    long_prompt = [(7 * j * j + 3) % (vocab - 3) + 3 for j in range(1500)]
    long = engine.add(GenerationRequest(long_prompt, GREEDY, 4, drafter="none"))
    engine.step()
    short = engine.add(GenerationRequest([5, 6, 7], GREEDY, 4, drafter="none"))
    steps_to_first_token = None
    for step in range(1, 200):
        events = engine.step()
        if any(s is short and isinstance(e, TokenEvent) for s, e in events):
            steps_to_first_token = step
            break
    assert steps_to_first_token is not None and steps_to_first_token <= 2
    if engine.batched.max_packed_rows:
        assert not long.prefilled  # the long prompt is still being fed beside it
    engine.abort(long)
    engine.abort(short)


def _scores(finish: FinishEvent) -> list[tuple[int, float | None, tuple]]:
    assert finish.prompt_logprobs is not None
    return [(s.token_id, s.logprob, s.rank, s.top_logprobs) for s in finish.prompt_logprobs]


def test_prompt_logprobs_equal_the_models_own_and_hold_under_load(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt scored alone (max_tokens 0: nothing generated) gives the model's own
    log-softmax of a plain forward over the prompt; the same bits beside decoding rows and
    fed in other chunk sizes."""
    import mlx.core as mx

    prompt = _prompts(engine.vocab_size, 12)[9] * 2
    scoring = GenerationRequest(prompt, GREEDY, max_tokens=0, prompt_logprobs=3)
    tokens, finish = generate(engine, scoring)
    assert tokens == [] and finish.finish_reason == "length"
    alone = _scores(finish)
    assert [token for token, _, _, _ in alone] == prompt
    assert alone[0][1:] == (None, None, ())
    target = engine.model.target
    logits, _ = target(mx.array(prompt)[None], target.make_cache())
    reference = (logits[0] - mx.logsumexp(logits[0], axis=-1, keepdims=True)).tolist()
    for position, (token, logprob, rank, top) in enumerate(alone[1:]):
        expected = reference[position]
        assert logprob == pytest.approx(expected[token], abs=1e-4)
        assert rank == 1 + sum(value > expected[token] + 1e-4 for value in expected)
        best = sorted(range(len(expected)), key=lambda t: -expected[t])[:3]
        assert [t for t, _ in top] == best
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    # Beside three decoding rows, and with a generated continuation.
    others = [GenerationRequest(p, GREEDY, max_tokens=12) for p in _prompts(engine.vocab_size, 3)]
    scored_and_generating = GenerationRequest(prompt, GREEDY, max_tokens=4, prompt_logprobs=3)
    _, last = run_batch(engine, [*others, scored_and_generating], join_at=[0, 0, 0, 2])
    assert _scores(last[3]) == alone
    monkeypatch.setattr(engine, "prefill_chunk_size", 5)
    _, last = run_batch(engine, [*others, scoring], join_at=[0, 0, 0, 1])
    assert _scores(last[3]) == alone


def test_a_prompt_alone_feeds_whole_forwards_and_beside_a_stream_few_tokens(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing decoding, a prompt feeds ``max_prefill_tokens`` a forward (384 where
    every product is quantized and attention runs in the fused kernel); beside a decoding
    stream, a step's tokens in all stay within 128, so the stream's gap stays short."""
    batched = engine.batched
    fed: list[list[int]] = []
    forward = batched.forward

    def recording(rows, tokens, logits="all"):
        fed.append([int(t.shape[0]) for t in tokens])
        return forward(rows, tokens, logits)

    monkeypatch.setattr(batched, "forward", recording)
    vocab = engine.vocab_size
    prompt = [(11 * j * j + 5) % (vocab - 3) + 3 for j in range(900)]
    _solo(engine, GenerationRequest(prompt, GREEDY, 1, drafter="none"))
    if not batched.max_packed_rows:  # one forward per row: prompts go in chunks of their own
        assert all(len(sizes) == 1 for sizes in fed)
        return
    largest = batched.max_prefill_tokens
    assert largest == (384 if engine.model.weights.startswith("affine") else 128)
    assert fed[0] == [largest] and max(map(sum, fed)) == largest
    fed.clear()
    stream = engine.add(GenerationRequest([5, 6, 7], GREEDY, 400, drafter="none"))
    while not any(s is stream and isinstance(e, TokenEvent) for s, e in engine.step()):
        pass
    fed.clear()
    long = engine.add(GenerationRequest(prompt, GREEDY, 1, drafter="none"))
    while not long.finished and not long.prefilled:
        engine.step()
    assert fed and max(map(sum, fed)) <= 128
    engine.abort(long)
    engine.abort(stream)
