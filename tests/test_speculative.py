"""The cycle: cache rollback leaves every cache as committed history alone would, and the
output distribution at temperature > 0 equals plain decoding's, enumerated exactly."""

from __future__ import annotations

import collections
import itertools
import math
import re
import types
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from mtplx import fused_layer
from mtplx.cycle import Draft
from mtplx.drafters import DraftModelDrafter, DraftSampler, MTPDrafter, NgramDrafter
from mtplx.drafters.base import CommitsEagerly, OneSource, ProposesAlone
from mtplx.engine import Engine
from mtplx.models import LoadedModel, load, make_layer_skip_draft
from mtplx.models.rows import RowOutput
from mtplx.request import GenerationRequest, SamplerConfig, TokenEvent
from mtplx.sampling.reference import distribution_from_logits
from mtplx.speculative import verify, verify_rows
from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.variants import untie_lm_head
from tests.test_engine import run_concurrently

GREEDY = SamplerConfig(temperature=0.0)
SIGNIFICANCE = 1e-3
LOGIT_TOLERANCE = 1e-4  # float32, a multi-token forward against one-token forwards


@pytest.fixture(scope="module", params=["llama_mtp", "qwen3_next"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    directory = tmp_path_factory.mktemp(request.param)
    build_checkpoint(request.param, directory)
    if request.param == "llama_mtp":
        untie_lm_head(directory)
    return load(directory)


class ScriptedDrafter(CommitsEagerly, OneSource, ProposesAlone):
    """Proposes the plain greedy continuation for the first ``num_right`` positions and a
    wrong token after, so a test controls how many draft tokens are accepted."""

    name = "scripted"
    needs_hidden = False
    draft_vocab = None

    def __init__(self, continuation: list[int], vocab_size: int) -> None:
        self.continuation = continuation
        self.vocab_size = vocab_size
        self.num_right = 0

    def reset(self, prompt_ids: list[int]) -> None:
        self.num_prompt = len(prompt_ids)

    def commit(self, new_tokens: list[int], target_hidden: mx.array | None) -> None:
        pass

    def propose(self, history, k, sample):
        start = len(history) - self.num_prompt
        tokens = []
        for position in range(k):
            right = self.continuation[start + position]
            tokens.append(right if position < self.num_right else (right + 1) % self.vocab_size)
        vocab = mx.arange(self.vocab_size)
        return [mx.array(t, mx.int32) for t in tokens], [
            (vocab == t).astype(mx.float32) for t in tokens
        ]


def _plain_greedy(model: LoadedModel, prompt: list[int], num_tokens: int) -> list[int]:
    engine = Engine(model)
    request = GenerationRequest(
        prompt, GREEDY, max_tokens=num_tokens, drafter="none", ignore_eos=True
    )
    return [e.token_id for e in engine.generate(request) if isinstance(e, TokenEvent)]


def _next_logits_from_history(model: LoadedModel, tokens: list[int]) -> mx.array:
    """Logits after ``tokens`` from a fresh cache fed the committed history alone."""
    cache = model.target.make_cache()
    logits, _ = model.target(mx.array(tokens, mx.int32)[None], cache)
    return logits[0, -1]


@settings(max_examples=12, deadline=None)
@given(schedule=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=1, max_size=8))
def test_rollback_leaves_target_row_as_committed_history(
    model: LoadedModel, schedule: list[tuple[int, int]]
) -> None:
    """Steps of random depth (0: plain, queued ahead) and accepted length: the committed
    tokens are plain decoding's, and the row then answers as a fresh cache fed the history."""
    prompt = [7, 3, 9, 12, 4]
    continuation = _plain_greedy(model, prompt, 60)
    engine = Engine(model)
    request = GenerationRequest(
        prompt, GREEDY, max_tokens=50, drafter="ngram", depth=0, ignore_eos=True
    )
    sequence = engine.add(request)
    drafter = ScriptedDrafter(continuation, model.target.vocab_size)
    drafter.reset(prompt)
    sequence.drafter = drafter
    tokens: list[int] = []
    for depth, num_right in schedule:
        sequence.depth = depth
        drafter.num_right = min(num_right, depth)
        tokens += [e.token_id for _, e in engine.step() if isinstance(e, TokenEvent)]
    while sequence in engine.in_flight:  # settle the queue
        sequence.depth = 1
        drafter.num_right = 1
        tokens += [e.token_id for _, e in engine.step() if isinstance(e, TokenEvent)]
    assert tokens == continuation[: len(tokens)]
    assert sequence.tokens == prompt + tokens
    last = mx.array(sequence.tokens[-1:], mx.int32)
    spec_logits = engine.batched.forward([sequence.row], [last])[0].logits
    expected = _next_logits_from_history(model, sequence.tokens)
    np.testing.assert_allclose(np.array(spec_logits[-1]), np.array(expected), atol=LOGIT_TOLERANCE)
    engine.abort(sequence)


def _target_hidden(model: LoadedModel, tokens: list[int]) -> mx.array:
    """[1, T, H] target hidden states of ``tokens`` from a fresh cache."""
    return model.target(mx.array(tokens, mx.int32)[None], model.target.make_cache())[1]


def _make_drafter(model: LoadedModel, name: str):
    if name == "mtp":
        return MTPDrafter(model)
    # A draft model: the layer-skip draft on llama; the whole target (a recurrent cache that
    # cannot be trimmed) on qwen3_next.
    draft = make_layer_skip_draft(model, 1) if model.model_type == "llama" else model.target
    return DraftModelDrafter(draft)


@pytest.mark.parametrize("drafter_name", ["mtp", "draft_model"])
@settings(max_examples=10, deadline=None)
@given(schedule=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 4)), min_size=1, max_size=5))
def test_drafter_state_matches_committed_history(
    model: LoadedModel, drafter_name: str, schedule: list[tuple[int, int]]
) -> None:
    """Random accept lengths: commit the first ``a`` draft tokens plus another token; the
    drafter then proposes exactly what a fresh drafter fed the committed history does."""
    vocab = model.target.vocab_size
    greedy = lambda k: DraftSampler(GREEDY, vocab, mx.zeros(k))  # noqa: E731
    prompt = [5, 9, 2, 8, 8, 1]
    history = [*prompt, 4]
    drafter = _make_drafter(model, drafter_name)
    drafter.reset(prompt)
    drafter.commit(history[1:], _target_hidden(model, history[:-1]))
    for depth, num_accepted in schedule:
        tokens, _ = drafter.propose(history, depth, greedy(depth))
        num_accepted = min(num_accepted, len(tokens))
        drafted = [int(t.item()) for t in tokens]
        last = (drafted[num_accepted] + 1) % vocab if num_accepted < len(drafted) else 7
        new = [*drafted[:num_accepted], last]
        hidden = _target_hidden(model, history + new[:-1])[:, len(history) - 1 :]
        drafter.commit(new, hidden)
        history += new
    fresh = _make_drafter(model, drafter_name)
    fresh.reset(history)
    fresh.commit(history[1:], _target_hidden(model, history[:-1]))
    _, used_q = drafter.propose(history, 3, greedy(3))
    _, fresh_q = fresh.propose(history, 3, greedy(3))
    for used, expected in zip(used_q, fresh_q, strict=True):
        np.testing.assert_array_equal(np.array(used), np.array(expected))


# ---------------------------------------------------------------------------------------------
# Temperature > 0: the first three generated tokens, against exact enumeration
# ---------------------------------------------------------------------------------------------

SMALL_VOCAB = 12
NUM_GENERATED = 3
NUM_RUNS = 1500
# The chi-square runs decode this many requests at once (continuous batching, one engine);
# the first NUM_ALONE of a case also run alone and, at a fixed depth, must emit the same
# tokens: a case's counts are then those of its requests run one at a time.
MAX_CONCURRENT = 64
NUM_ALONE = 8
SLOW = pytest.mark.slow  # the longest chi-square runs: `make test-slow`


def sample_counts(
    engine: Engine, requests: list[GenerationRequest], num_alone: int = NUM_ALONE
) -> dict[tuple[int, ...], int]:
    """How often each output occurs among ``requests`` run concurrently; the first
    ``num_alone`` are also run alone and, at a fixed depth, must emit the same tokens there
    (an adaptive depth follows the batch's size, and a seed's draws follow the depth)."""
    outputs = run_concurrently(engine, requests)
    for request, together in zip(requests[:num_alone], outputs, strict=False):
        if request.depth is None:
            continue
        alone = tuple(e.token_id for e in engine.generate(request) if isinstance(e, TokenEvent))
        assert alone == together, request.sampler.seed
    observed: dict[tuple[int, ...], int] = {}
    for output in outputs:
        observed[output] = observed.get(output, 0) + 1
    return observed


@pytest.fixture(scope="module")
def small_vocab_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    directory = tmp_path_factory.mktemp("small_vocab")
    build_checkpoint("llama_mtp", directory)
    untie_lm_head(directory, logit_scale=2.0, vocab_size=SMALL_VOCAB)
    model = load(directory)
    draft = make_layer_skip_draft(model, 1)
    return Engine(model, draft_model=draft, max_num_seqs=MAX_CONCURRENT)


@pytest.fixture(scope="module")
def small_vocab_reduced_draft_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The small-vocabulary model whose MTP head drafts over only 8 of its 12 tokens."""
    directory = tmp_path_factory.mktemp("small_vocab_reduced")
    build_checkpoint("llama_mtp", directory)
    untie_lm_head(directory, logit_scale=2.0, vocab_size=SMALL_VOCAB)
    head = mx.load(str(directory / "mtp.safetensors"))
    draft_vocab = np.array([0, 2, 3, 5, 6, 8, 9, 11], dtype=np.int32)
    rng = np.random.default_rng(5)
    head["mtp.draft_vocab"] = mx.array(draft_vocab)
    head["mtp.lm_head.weight"] = mx.array(
        (rng.standard_normal((len(draft_vocab), 64)) * 0.25).astype(np.float32)
    )
    mx.save_safetensors(str(directory / "mtp.safetensors"), head)
    model = load(directory)
    assert model.draft_vocab is not None
    return Engine(model, max_num_seqs=MAX_CONCURRENT)


@pytest.mark.slow  # 1,500 engine runs; the rule with any q stays in the default tier
def test_reduced_draft_vocabulary_follows_plain_decoding_distribution(
    small_vocab_reduced_draft_engine: Engine,
) -> None:
    engine = small_vocab_reduced_draft_engine
    prompt = [1, 2, 3, 1, 2]
    config = SamplerConfig(temperature=0.9, top_p=0.95)
    exact = _exact_first_tokens(engine, prompt, config)
    requests = [
        GenerationRequest(
            prompt,
            SamplerConfig(temperature=0.9, top_p=0.95, seed=run),
            max_tokens=NUM_GENERATED,
            drafter="mtp",
            depth=2,
            ignore_eos=True,
        )
        for run in range(NUM_RUNS)
    ]
    observed = sample_counts(engine, requests)
    assert _chi_square_pvalue(observed, exact, NUM_RUNS) > SIGNIFICANCE


def _exact_first_tokens(engine: Engine, prompt: list[int], config: SamplerConfig) -> dict:
    """P(t1, t2, t3) of plain decoding: prod of the sampling distribution along each path,
    with penalties counting the earlier generated tokens."""
    prefixes = {(): 1.0}
    for _position in range(NUM_GENERATED):
        next_prefixes = {}
        for prefix, mass in prefixes.items():
            if mass == 0.0:
                continue
            logits = np.array(_next_logits_from_history(engine.model, prompt + list(prefix)))
            counts = np.bincount(np.array(prefix, dtype=int), minlength=SMALL_VOCAB)
            probs = distribution_from_logits(logits.astype(np.float64), config, counts)
            for token in range(SMALL_VOCAB):
                next_prefixes[(*prefix, token)] = mass * probs[token]
        prefixes = next_prefixes
    sequences = itertools.product(range(SMALL_VOCAB), repeat=NUM_GENERATED)
    exact = {sequence: prefixes.get(sequence, 0.0) for sequence in sequences}
    assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-9)
    return exact


def _chi_square_pvalue(observed: dict, exact: dict, num_runs: int) -> float:
    """Chi-square over sequences, pooling those with expected count < 5 into one cell."""
    expected_counts, observed_counts = [], []
    pooled_expected = pooled_observed = 0.0
    for sequence, probability in exact.items():
        expected = probability * num_runs
        count = observed.get(sequence, 0)
        if expected < 5:
            pooled_expected += expected
            pooled_observed += count
        else:
            expected_counts.append(expected)
            observed_counts.append(count)
    assert sum(observed.get(s, 0) for s, p in exact.items() if p == 0.0) == 0, "impossible output"
    expected_counts.append(pooled_expected)
    observed_counts.append(pooled_observed)
    return stats.chisquare(observed_counts, expected_counts).pvalue


# 1,500 seeded runs a case, decoded concurrently. The default tier keeps the
# lookup-first case (both drafters of a mix); every drafter's statistics in the default tier
# also come from tests/test_engine_batching.py (rows of different drafters and samplers in
# one batch) and the rule's from tests/sampling/test_mlx_ops.py (30,000 sequences verified
# at once).
# The other cases run in `make test-slow`.
@pytest.mark.parametrize(
    "drafter, config",
    [
        pytest.param("none", SamplerConfig(temperature=0.8), id="plain", marks=SLOW),
        pytest.param(
            "mtp",
            SamplerConfig(temperature=0.8, top_k=6, top_p=0.9),
            id="mtp-topk-topp",
            marks=SLOW,
        ),
        pytest.param(
            "draft_model",
            SamplerConfig(temperature=1.0, min_p=0.05, repetition_penalty=1.3),
            id="draft-minp-repetition",
            marks=SLOW,
        ),
        pytest.param(
            "ngram",
            SamplerConfig(temperature=0.7, frequency_penalty=0.8, presence_penalty=0.5),
            id="ngram-penalties",
            marks=SLOW,
        ),
        pytest.param(
            "mtp",
            SamplerConfig(temperature=1.1, presence_penalty=1.0, top_k=8),
            id="mtp-penalties",
            marks=SLOW,
        ),
        pytest.param(
            "mtp+ngram", SamplerConfig(temperature=0.9, top_p=0.95), id="lookup-first-topp"
        ),
    ],
)
def test_first_tokens_follow_plain_decoding_distribution(
    small_vocab_engine: Engine, drafter: str, config: SamplerConfig
) -> None:
    prompt = [1, 2, 3, 1, 2]  # a repeat, so the n-gram drafter proposes
    exact = _exact_first_tokens(small_vocab_engine, prompt, config)
    requests = [
        GenerationRequest(
            prompt,
            SamplerConfig(**{**config.__dict__, "seed": run, "logit_bias": {}}),
            max_tokens=NUM_GENERATED,
            drafter=drafter,
            depth=2,
            ignore_eos=True,
        )
        for run in range(NUM_RUNS)
    ]
    observed = sample_counts(small_vocab_engine, requests)
    assert _chi_square_pvalue(observed, exact, NUM_RUNS) > SIGNIFICANCE


def test_ngram_drafter_is_exact_under_sampling_negative_control(small_vocab_engine: Engine) -> None:
    """The same chi-square detects a biased sampler: sampling at T=1.0 checked against the
    T=0.8 enumeration must fail."""
    prompt = [1, 2, 3, 1, 2]
    exact = _exact_first_tokens(small_vocab_engine, prompt, SamplerConfig(temperature=0.8))
    requests = [
        GenerationRequest(
            prompt,
            SamplerConfig(temperature=1.6, seed=run),
            max_tokens=NUM_GENERATED,
            drafter="ngram",
            depth=2,
            ignore_eos=True,
        )
        for run in range(NUM_RUNS)
    ]
    observed = sample_counts(small_vocab_engine, requests)
    assert _chi_square_pvalue(observed, exact, NUM_RUNS) < 1e-6


def test_ngram_drafter_proposes_nothing_without_a_match() -> None:
    drafter = NgramDrafter()
    tokens, qs = drafter.propose([1, 2, 3], 3, DraftSampler(GREEDY, 10, mx.zeros(3)))
    assert tokens == [] and qs == []


def test_plain_rows_drawn_together_equal_each_row_drawn_alone() -> None:
    """``queue_plain_rows`` (rows grouped by sampler, one draw per group) against its
    reference ``queue_plain`` (one row at a time): the same token for every row, including
    near ties and rows that share a sampler but not a seed."""
    from types import SimpleNamespace

    from mtplx.models.batched import RowOutput
    from mtplx.speculative import queue_plain, queue_plain_rows

    vocab = 3000
    configs = [
        GREEDY,
        SamplerConfig(temperature=0.0, logit_bias={7: 100.0}),
        SamplerConfig(temperature=0.7, seed=1),
        SamplerConfig(temperature=0.7, seed=2),
        SamplerConfig(temperature=0.7),
        SamplerConfig(temperature=0.9, top_p=0.9, seed=3),
        SamplerConfig(temperature=0.9, top_p=0.9, seed=4),
        SamplerConfig(temperature=1.2, top_k=20, min_p=0.05, seed=5),
        SamplerConfig(temperature=0.7, logit_bias={3: -5.0}, seed=6),
        GREEDY,
    ]
    for trial in range(5):
        rng = np.random.default_rng(trial)
        logits = rng.normal(0, 3, size=(len(configs), vocab)).astype(np.float32)
        logits[:, 11] = logits[:, 12]  # exact ties resolve to the lowest id in both paths
        logits[0, 12] = logits[0].max() + 1
        logits[0, 11] = logits[0, 12]
        head = mx.array(logits)
        outputs = [RowOutput(head[i : i + 1], mx.zeros((1, 4))) for i in range(len(configs))]
        sequences = [
            SimpleNamespace(
                config=config,
                seed=100 + i if config.seed is None else config.seed,
                tokens=list(range(5 + i + trial)),
            )
            for i, config in enumerate(configs)
        ]
        fed_ahead = [i % 2 == 0 for i in range(len(configs))]  # half feed a queued draw
        together = queue_plain_rows(sequences, outputs, fed_ahead)  # type: ignore[arg-type]
        for sequence, output, ahead, fed in zip(
            sequences, outputs, together, fed_ahead, strict=True
        ):
            alone = queue_plain(sequence, output, fed)  # type: ignore[arg-type]
            assert ahead.sample.tolist() == alone.sample.tolist(), sequence.config
            assert ahead.logits is output.logits and ahead.hidden is output.hidden


@pytest.mark.parametrize("kernel", [True, False], ids=["verdict-node", "mlx-ops"])
def test_verify_rows_gives_each_row_its_own_verdict(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of depths 0..5 (greedy ones a verdict node each, or without the kernel
    verified together over their flattened positions; sampled and biased ones alone),
    logits with ties and drafts that match for a while: every row's accept count and output
    tokens equal ``verify`` on the row alone."""
    assert fused_layer.available()
    if not kernel:
        monkeypatch.setattr(fused_layer, "available", lambda: False)
    rng = np.random.default_rng(7)
    vocab = 50
    configs = [
        GREEDY,
        SamplerConfig(temperature=0.8, seed=3),
        SamplerConfig(temperature=0.0, logit_bias={4: 2.0}),
    ]
    rows = []
    for index in range(18):
        k = index % 6
        logits = rng.integers(0, 4, size=(k + 1, vocab)).astype(np.float32)  # many ties
        greedy = logits.argmax(-1)
        right = rng.integers(0, k + 1)  # drafts match the argmax this far, then may not
        tokens = [int(greedy[j]) if j < right else int(rng.integers(0, vocab)) for j in range(k)]
        config = configs[0] if index % 4 else configs[1 + index % 8 // 4]
        sequence = types.SimpleNamespace(config=config, token_counts=None, grammar=None)
        qs = [(mx.arange(vocab) == t).astype(mx.float32) for t in tokens]
        uniforms = mx.array(rng.random(2 * k + 1, dtype=np.float32))
        draft = Draft(mx.array(tokens, mx.int32), qs, uniforms, k, 0.0)
        hidden = mx.zeros((k + 1, 4))
        rows.append((sequence, draft, RowOutput(mx.array(logits), hidden)))
    got = verify_rows(rows)
    for index, (row, (accepted, output)) in enumerate(zip(rows, got, strict=True)):
        want_accepted, want_output = verify(*row)
        assert accepted.shape == want_accepted.shape and output.shape == want_output.shape
        assert accepted.tolist() == want_accepted.tolist(), index
        assert output.tolist() == want_output.tolist(), index
    assert sum(int(a.item()) for a, _ in got) > 0  # some drafts were accepted


def test_greedy_rows_are_a_verdict_node_each(tmp_path: Path) -> None:
    """Four greedy rows of depths 1..4 verified together: one ``MTPLXGreedyVerdict`` node a
    row and nothing else (the rows' logits and drafts are evaluated), where MLX's ops over
    the rows together are an argmax, gathers, a cumulative product and slices."""
    rng = np.random.default_rng(3)
    rows = []
    for k in range(1, 5):
        logits = mx.array(rng.normal(size=(k + 1, 50)).astype(np.float32))
        tokens = mx.array(rng.integers(0, 50, size=k), mx.int32)
        sequence = types.SimpleNamespace(config=GREEDY, token_counts=None, grammar=None)
        draft = Draft(tokens, [], mx.zeros((2 * k + 1,)), k, 0.0)
        rows.append((sequence, draft, RowOutput(logits, mx.zeros((k + 1, 4)))))
    verdicts = verify_rows(rows)  # type: ignore[arg-type]
    path = tmp_path / "verdicts.dot"
    mx.export_to_dot(str(path), *[a for verdict in verdicts for a in verdict])
    nodes = collections.Counter(re.findall(r'label ="(\w+)"', path.read_text()))
    assert nodes == {"MTPLXGreedyVerdict": 4}, nodes
