"""The sampled path's kernel nodes (``mtplx.sampling.fast_path``: ``distribution``, ``sample``,
``sample_logits``, ``verify_sampled_row`` where ``sampling_kernel`` serves) against the MLX ops
they replace (``mx_distribution_from_logits``, ``mx_sample``, ``mx_verify_draft_tokens``): p bit
for bit, and a row's p the same bits in any batch; the same tokens and accept counts given
the same p and uniforms; the NumPy references' decisions; an enumeration of every draft and
uniform on a small vocabulary whose output marginal is p exactly; and, through the engine,
the same seeded outputs with the kernel on and off, and speculative sampled output
distributed as plain sampled output (chi-square, fixed seeds)."""

from __future__ import annotations

import dataclasses
import io
import re
from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats

from mtplx.engine import Engine
from mtplx.models import load, make_layer_skip_draft
from mtplx.request import GenerationRequest, SamplerConfig
from mtplx.sampling import fast_path
from mtplx.sampling.fast_path import distribution, sample, sample_logits, verify_sampled_row
from mtplx.sampling.mlx_ops import mx_distribution_from_logits, mx_sample, mx_verify_draft_tokens
from mtplx.sampling.reference import (
    distribution_from_logits,
    speculative_output_marginal,
    verify_draft_tokens_reference,
)
from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.variants import untie_lm_head
from tests.test_engine import run_concurrently

pytestmark = pytest.mark.skipif(
    fast_path.sampling_kernel() is None, reason="no sampling kernel here"
)

TEMPERATURES = [1e-5, 0.1, 0.6, 1.0, 7.0, 1e4]


@pytest.fixture
def mlx_ops(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Within the block: the MLX ops serve (``MTPLX_SAMPLED_KERNEL=0``)."""
    monkeypatch.setattr(fast_path, "_KERNEL_ON", False)
    yield


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).view(np.uint32)


def _logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """Logits of every scale, with -inf sprinkled in (grammar masks, a -100 bias's kind of
    gap), a row with one finite entry, and ties."""
    scale = rng.choice([0.5, 4.0, 30.0])
    logits = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
    logits[rng.random((rows, vocab)) < 0.2] = -np.inf
    logits[:, 0] = 1.5  # never a row of -inf alone
    if vocab > 3:
        logits[0, 1:] = -np.inf
        logits[-1, 2:4] = -100.0
        logits[-1, 1] = 1.5  # a tie with the first
    return logits


@pytest.mark.parametrize("vocab", [1, 7, 33, 300, 49152])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_distribution_is_mx_distribution_from_logits_bits(vocab: int, temperature: float) -> None:
    rng = np.random.default_rng(vocab)
    logits = mx.array(_logits(rng, 5, vocab))
    config = SamplerConfig(temperature=temperature)
    want = mx_distribution_from_logits(logits, config)
    np.testing.assert_array_equal(_bits(distribution(logits, config)), _bits(want))
    # Any leading shape: [1, 5, V] as [5, V].
    np.testing.assert_array_equal(_bits(distribution(logits[None], config)[0]), _bits(want))


def test_distribution_rows_are_the_same_bits_in_any_batch() -> None:
    """A row's p alone, and among 1 .. 16 other rows at any place in the batch."""
    rng = np.random.default_rng(7)
    config = SamplerConfig(temperature=0.6)
    table = _logits(rng, 16, 49152)
    alone = [_bits(distribution(mx.array(table[i : i + 1]), config))[0] for i in range(16)]
    for rows in (2, 3, 5, 16):
        order = rng.permutation(16)[:rows]
        together = _bits(distribution(mx.array(table[order]), config))
        for slot, i in enumerate(order):
            np.testing.assert_array_equal(together[slot], alone[i])


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_distribution_is_the_numpy_reference_within_float_rounding(temperature: float) -> None:
    rng = np.random.default_rng(11)
    logits = _logits(rng, 4, 3000)
    config = SamplerConfig(temperature=temperature)
    got = np.array(distribution(mx.array(logits), config)).astype(np.float64)
    want = distribution_from_logits(logits.astype(np.float64), config)
    # Each p_j is a few float32 roundings off, and the normaliser a sequential float32 sum of
    # V terms: within its textbook bound of V units in the last place, relative.
    bound = (logits.shape[-1] + 8) * 2.0**-24
    np.testing.assert_allclose(got, want, rtol=bound, atol=1e-37)  # exp(-88) and below: 0


@pytest.mark.parametrize(
    "config",
    [
        SamplerConfig(temperature=0.8, top_p=0.9),
        SamplerConfig(temperature=0.6, top_k=20, top_p=0.95),
        SamplerConfig(temperature=1.2, top_k=20, min_p=0.05),
        SamplerConfig(temperature=0.7, min_p=0.1),
        SamplerConfig(temperature=0.7, logit_bias={3: -100.0, 5: 4.0}, top_k=50),
        SamplerConfig(temperature=0.9, top_k=1),
        SamplerConfig(temperature=0.9, top_k=1999, top_p=0.5),
        SamplerConfig(temperature=0.9, top_k=2000),  # the whole vocabulary: no filter
        SamplerConfig(temperature=0.9, top_k=2**31, top_p=0.5),  # past a C int
        SamplerConfig(temperature=0.9, top_k=2**64 + 1),  # past an int64
        SamplerConfig(temperature=2.0, top_k=300, top_p=0.9, min_p=0.001),
        SamplerConfig(temperature=1.0, top_k=7, top_p=1e-9),
        SamplerConfig(temperature=1.0, top_k=40, top_p=0.999999),
        SamplerConfig(temperature=0.6, top_p=0.95),
        SamplerConfig(temperature=1.0, top_p=1e-9),
        SamplerConfig(temperature=1.0, top_p=1e-60),
        SamplerConfig(temperature=1.0, top_p=0.99999994),
        SamplerConfig(temperature=0.8, top_p=0.5, min_p=0.01),
    ],
)
@pytest.mark.parametrize("ties", [False, True])
def test_distribution_with_filters_and_bias_is_the_mlx_ops_bits(
    config: SamplerConfig, ties: bool
) -> None:
    """The filters in the node: ties at the top-k and top-p boundaries (small integer
    logits), k above the node's insertion buffer, a nucleus of one, a top_p near 1."""
    rng = np.random.default_rng(13)
    logits = _logits(rng, 3, 2000)
    if ties:
        logits = np.where(np.isfinite(logits), np.round(logits / 4.0), logits).astype(np.float32)
    logits = mx.array(logits)
    want = mx_distribution_from_logits(logits, config)
    np.testing.assert_array_equal(_bits(distribution(logits, config)), _bits(want))


def test_draw_is_mx_sample_ints() -> None:
    """Unnormalised weights with zeros (the last ones too), uniforms 0, just below 1 (the
    threshold then rounds up to the total), and random."""
    rng = np.random.default_rng(17)
    for vocab in (1, 2, 9, 1000, 49152):
        weights = rng.random((12, vocab)).astype(np.float32) * rng.choice([1e-30, 1.0, 1e30])
        weights[rng.random((12, vocab)) < 0.5] = 0.0
        weights[:, 0] = 1e-3 if vocab > 1 else 1.0
        weights[:6, vocab // 2 :] = 0.0
        uniforms = rng.random(12).astype(np.float32)
        uniforms[:3] = [0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5]
        w, u = mx.array(weights), mx.array(uniforms)
        got = sample(w, u)
        assert got.dtype == mx.int32 and got.shape == (12,)
        np.testing.assert_array_equal(np.array(got), np.array(mx_sample(w, u)))


@pytest.mark.parametrize(
    "config",
    [
        SamplerConfig(temperature=0.6),
        SamplerConfig(temperature=1e-5),
        SamplerConfig(temperature=1e4),
        SamplerConfig(temperature=0.9, top_p=0.9),
        SamplerConfig(temperature=0.7, logit_bias={0: -100.0}),
        SamplerConfig(temperature=0.0, logit_bias={2: 3.0}),
    ],
)
def test_sample_logits_draws_mx_samples_tokens(config: SamplerConfig) -> None:
    rng = np.random.default_rng(19)
    logits = mx.array(_logits(rng, 40, 4000))
    uniforms = mx.array(rng.random(40).astype(np.float32))
    want = mx_sample(mx_distribution_from_logits(logits, config), uniforms).astype(mx.int32)
    np.testing.assert_array_equal(np.array(sample_logits(logits, config, uniforms)), want)


def _verdict_case(
    rng: np.random.Generator, k: int, vocab: int, config: SamplerConfig
) -> tuple[mx.array, mx.array, list[mx.array], mx.array]:
    """Target logits [k+1, V], drafts [k], q rows, uniforms [2k+1]: drafts mostly at likely
    tokens (every accept count occurs), q sometimes 0 at the draft, sometimes p itself or
    just above it (a rejection then leaves no residual mass), the draw's uniform sometimes
    just below 1."""
    logits = _logits(rng, k + 1, vocab)
    p = np.array(mx_distribution_from_logits(mx.array(logits), config))
    drafts, qs = [], []
    for i in range(k):
        q = rng.dirichlet(np.full(vocab, 0.3)).astype(np.float32)
        kind = rng.random()
        if kind < 0.2:
            q = p[i].copy()  # the ratio is 1: always accepted
        elif kind < 0.4:
            # q above p everywhere: a rejection (the ratio below 1, the uniform above it)
            # leaves no residual mass, and the draw falls back to p
            q = (p[i] * np.float32(1.001)).astype(np.float32)
        token = int(np.argmax(p[i] * rng.random(vocab)))
        if kind > 0.9:
            q[token] = 0.0  # a draft the drafter could not have drawn: rejected
        drafts.append(token)
        qs.append(mx.array(q))
    uniforms = rng.random(2 * k + 1).astype(np.float32)
    uniforms[k : 2 * k][uniforms[k : 2 * k] > 0.9] = np.float32(0.9995)  # rejects q = 1.001 p
    if rng.random() < 0.2:
        uniforms[-1] = np.nextafter(np.float32(1), np.float32(0))
    return mx.array(logits), mx.array(np.array(drafts, np.int32)), qs, mx.array(uniforms)


CONFIGS = [
    SamplerConfig(temperature=0.6),
    SamplerConfig(temperature=0.6, top_k=20, top_p=0.95),
    SamplerConfig(temperature=1e-5),
    SamplerConfig(temperature=1e4),
    SamplerConfig(temperature=0.9, top_p=0.8),
    SamplerConfig(temperature=0.9, top_p=0.99999994),
    SamplerConfig(temperature=1.1, top_k=5, min_p=0.02),
    SamplerConfig(temperature=0.8, logit_bias={1: -100.0}),
]


@pytest.mark.parametrize("k", [0, 1, 2, 5])
@pytest.mark.parametrize("vocab", [3, 300, 49152])
def test_verdict_is_mx_verify_draft_tokens_ints(k: int, vocab: int) -> None:
    """The kernel's verdict (from the logits, or from filtered p) against MLX's ops on the
    same p and uniforms, and against the NumPy reference on that p."""
    rng = np.random.default_rng(100 * k + vocab)
    counts = np.zeros(k + 1, int)
    for trial in range(120 if vocab < 49152 else 14):
        config = CONFIGS[trial % len(CONFIGS)]
        logits, drafts, qs, uniforms = _verdict_case(rng, k, vocab, config)
        got = verify_sampled_row(logits, config, drafts, qs, uniforms, k, 2 * k)
        p = mx_distribution_from_logits(logits, config)
        q = mx.stack(qs)[None] if k else mx.zeros((1, 0, vocab), mx.float32)
        want = mx_verify_draft_tokens(
            p[None], q, drafts[None], uniforms[k : 2 * k][None], uniforms[2 * k :]
        )
        reference = verify_draft_tokens_reference(
            np.array(p)[None],
            np.array(q),
            np.array(drafts)[None],
            np.array(uniforms[k : 2 * k])[None],
            np.array(uniforms[2 * k :]),
        )
        assert got[0].dtype == got[1].dtype == mx.int32
        assert got[0].shape == (1,) and got[1].shape == (1, k + 1)
        for g, w, r in zip(got, want, reference, strict=True):
            np.testing.assert_array_equal(np.array(g), np.array(w))
            np.testing.assert_array_equal(np.array(g), r)
        counts[int(np.array(got[0])[0])] += 1
    if k and vocab < 49152:
        assert (counts > 0).all(), counts  # every accept count occurred


def test_verdict_with_penalties_and_masks_is_the_mlx_ops_verdict(mlx_ops: None) -> None:
    """Penalty counts and grammar masks [k+1, V], the kernel on and off."""
    rng = np.random.default_rng(23)
    config = SamplerConfig(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5)
    for _ in range(20):
        logits, drafts, qs, uniforms = _verdict_case(rng, 2, 500, config)
        counts = mx.array(rng.integers(0, 3, (3, 500)).astype(np.int32))
        masks = mx.array(rng.random((3, 500)) < 0.7) | (mx.arange(500) == 0)
        args = (logits, config, drafts, qs, uniforms, 2, 4, counts, masks)
        want = verify_sampled_row(*args)  # MLX's ops (the fixture)
        fast_path._KERNEL_ON = True
        try:
            got = verify_sampled_row(*args)
        finally:
            fast_path._KERNEL_ON = False
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.array(g), np.array(w))


def test_verdict_is_one_node_without_filters() -> None:
    logits = mx.array(np.zeros((2, 49152), np.float32))
    drafts, q = mx.array([5], mx.int32), mx.full((49152,), 1 / 49152)
    uniforms = mx.array([0.1, 0.2, 0.3], mx.float32)
    mx.eval(logits, drafts, q, uniforms)
    out = io.StringIO()
    mx.export_to_dot(
        out,
        *verify_sampled_row(logits, SamplerConfig(temperature=0.6), drafts, [q], uniforms, 1, 2),
    )
    assert re.findall(r'label ="([^"]+)", shape=rectangle', out.getvalue()) == [
        "MTPLXSampledVerdict"
    ]


def test_verdict_rejects_a_draft_outside_the_vocabulary() -> None:
    logits = mx.zeros((2, 10))
    uniforms = mx.array([0.1, 0.2, 0.3], mx.float32)
    verdict = verify_sampled_row(
        logits, SamplerConfig(), mx.array([10], mx.int32), [mx.full((10,), 0.1)], uniforms, 1, 2
    )
    with pytest.raises(RuntimeError):
        mx.eval(*verdict)


# Exactly representable (p, q) pairs: every acceptance probability and inverse-CDF boundary
# is a multiple of 1 / GRID, so counting outputs over a grid of uniforms is exact.
GRID = 32
DYADIC_PAIRS = [
    ([0.5, 0.25, 0.25, 0.0], [0.25, 0.5, 0.0, 0.25]),  # rejections, q = 0, p = 0 at a draft
    ([0.5, 0.25, 0.125, 0.125], [0.5, 0.25, 0.125, 0.125]),  # q = p: no residual mass
    ([0.0, 0.75, 0.25, 0.0], [0.5, 0.25, 0.25, 0.0]),  # draft never accepted at token 0
]


@pytest.mark.parametrize(("p", "q"), DYADIC_PAIRS)
def test_verdict_output_marginal_is_p_by_enumeration(p: list[float], q: list[float]) -> None:
    """Every draft token x (weight q(x)) and every accept and draw uniform on a grid: the
    kernel's first emitted token is distributed as p exactly, as the oracle says."""
    target = np.array([p, p], np.float32)  # the draft position's p, then the bonus's
    draft_q = mx.array(np.array(q, np.float32))
    grid = (np.arange(GRID, dtype=np.float32) + 0.5) / GRID
    kernel = fast_path.sampling_kernel()
    assert kernel is not None
    marginal = np.zeros(len(p))
    for x in np.flatnonzero(np.array(q) > 0):
        for accept_u in grid:
            for sample_u in grid:
                uniforms = mx.array(np.array([0.0, accept_u, sample_u], np.float32))
                _, tokens = kernel.sampled_verdict(  # p given (temperature 0: read as is)
                    mx.array(target), mx.array([int(x)], mx.int32), uniforms, [draft_q], 0.0, 1, 2
                )
                marginal[int(np.array(tokens)[0, 0])] += q[x] / GRID**2
    np.testing.assert_array_equal(marginal, np.array(p))
    np.testing.assert_array_equal(speculative_output_marginal(np.array(p), np.array(q)), p)


# -- through the engine ---------------------------------------------------------------------

SMALL_VOCAB = 12


@pytest.fixture(scope="module")
def small_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    directory = tmp_path_factory.mktemp("sampled_small_vocab")
    build_checkpoint("llama_mtp", directory)
    untie_lm_head(directory, logit_scale=2.0, vocab_size=SMALL_VOCAB)
    model = load(directory)
    return Engine(model, draft_model=make_layer_skip_draft(model, 1), max_num_seqs=32)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    directory = tmp_path_factory.mktemp("sampled_llama")
    build_checkpoint("llama_mtp", directory)
    untie_lm_head(directory, logit_scale=2.0)
    model = load(directory)
    return Engine(model, draft_model=make_layer_skip_draft(model, 1), max_num_seqs=16)


def test_seeded_outputs_are_the_same_with_the_kernel_on_and_off(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain, MTP and draft-model decoding, with filters, bias and penalties: the kernel's
    bits are MLX's ops' bits, so every seeded request emits the same tokens."""
    configs = [
        SamplerConfig(temperature=0.8),
        SamplerConfig(temperature=0.9, top_p=0.9),
        SamplerConfig(temperature=1.2, top_k=20, min_p=0.02, logit_bias={7: -100.0}),
        SamplerConfig(temperature=0.7, repetition_penalty=1.3),
        SamplerConfig(temperature=0.0),
    ]
    requests = [
        GenerationRequest(
            [1, 2, 3, 4, 5, seed % 7 + 6],
            dataclasses.replace(config, seed=seed),
            max_tokens=24,
            drafter=drafter,
            depth=depth,
            ignore_eos=True,
        )
        for seed, config in enumerate(configs)
        for drafter, depth in (("none", 0), ("mtp", 1), ("mtp", 3), ("draft_model", 2))
    ]
    with_kernel = run_concurrently(engine, requests)
    monkeypatch.setattr(fast_path, "_KERNEL_ON", False)
    assert run_concurrently(engine, requests) == with_kernel


def test_speculative_sampled_output_is_distributed_as_plain_sampled_output(
    small_engine: Engine,
) -> None:
    """The first three tokens after the prompt over 600 seeds, plain against MTP at depth
    2: one distribution (chi-square homogeneity over the outputs, rare ones pooled)."""
    runs = 600

    def outputs(drafter: str, depth: int) -> list[tuple[int, ...]]:
        return run_concurrently(
            small_engine,
            [
                GenerationRequest(
                    [1, 2, 3, 1, 2],
                    SamplerConfig(temperature=0.8, seed=1000 * depth + run),
                    max_tokens=3,
                    drafter=drafter,
                    depth=depth,
                    ignore_eos=True,
                )
                for run in range(runs)
            ],
        )

    plain, speculative = outputs("none", 0), outputs("mtp", 2)
    cells = sorted(set(plain) | set(speculative))
    table = np.array([[plain.count(c) for c in cells], [speculative.count(c) for c in cells]])
    common = table.sum(axis=0) >= 10
    pooled = np.column_stack([table[:, common], table[:, ~common].sum(axis=1)])
    assert stats.chi2_contingency(pooled).pvalue > 1e-3


def test_plain_sampled_decoding_writes_the_kv_stores_in_place() -> None:
    """A plain row's forward is queued before the previous one has run (its input is that
    one's lazy draw), and a layer node writes a KV store in place only when the previous
    write of that store has run by the time MLX dispatches the next: MLX decides donation
    at dispatch, and its CPU stream keeps each node's buffers until the node has run. On
    the default model each plain step's graph, with ``sample_logits``' two nodes, keeps
    MLX's host (at most ~100 dispatches ahead) off the previous step's writes: no store
    copied. One node fewer in the step copies stores in about half the requests
    (benchmarks/results/2026-12-04-store-copies/)."""
    from mtplx import fused_layer
    from mtplx.engine import Engine
    from mtplx.models import load
    from mtplx.models.gguf import ensure_default_model
    from mtplx.request import GenerationRequest, TokenEvent

    engine = Engine(load(ensure_default_model()))
    copies = fused_layer.store_copies() if fused_layer.available() else 0
    for seed in range(3):
        request = GenerationRequest(
            [1, 2, 3, 4, 5, 6, 7, 8],
            SamplerConfig(temperature=0.6, seed=seed),
            48,
            ignore_eos=True,
            drafter="none",
            depth=0,
        )
        tokens = [e for e in engine.generate(request) if isinstance(e, TokenEvent)]
        assert len(tokens) == 48
    if fused_layer.available():
        assert fused_layer.store_copies() == copies
