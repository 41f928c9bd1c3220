"""Constrained decoding: the grammar state (masks, stop tokens, rollback), and generation
under a grammar, exact with and without drafting: chi-square against the exact enumeration
of plain constrained sampling on a 12-token model, greedy output identical for every
drafter and depth, alone or in a batch, with unconstrained rows untouched."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from scipy import stats

from mtplx.engine import Engine
from mtplx.errors import InvalidParameter
from mtplx.grammar import MAX_GRAMMAR_CHARS, GrammarCompiler, GrammarSpec, check_grammar
from mtplx.models import load, make_layer_skip_draft
from mtplx.request import FinishEvent, GenerationRequest, SamplerConfig, TokenEvent
from mtplx.sampling.reference import distribution_from_logits
from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.tokenizer import IM_END_ID
from tests.fixtures.variants import untie_lm_head
from tests.test_engine_batching import run_batch
from tests.test_speculative import MAX_CONCURRENT, _next_logits_from_history, sample_counts

GREEDY = SamplerConfig(temperature=0.0)
SIGNIFICANCE = 1e-3
SMALL_VOCAB = 12  # token i is the byte symbol "!\"#$%&'()*+,"[i]
NUM_GENERATED = 3
NUM_RUNS = 1500
SLOW = pytest.mark.slow  # the longest chi-square runs: `make test-slow`
DRAFTERS = ("none", "mtp", "draft_model", "ngram", "mtp+ngram")

# Over the small vocabulary: '!' = 0, '"' = 1, '#' = 2, '$' = 3, '%' = 4, ',' = 11.
# FINISHING: any of "!", "\"#", "%", then "$", after which nothing may follow.
FINISHING = GrammarSpec("lark", 'start: ("!" | "\\"#" | "%")* "$"')
# OPEN: one or more of "!", "\"#"; complete after each, so a stop token may end it.
OPEN = GrammarSpec("lark", 'start: ("!" | "\\"#")+')
STOP = 11
# QUOTED: a quoted string of "!", "#", "%": complete (and finished) at its closing quote.
QUOTED = GrammarSpec("lark", 'start: "\\"" ("!" | "#" | "%")* "\\""')


def _chi_square_pvalue(observed: dict, exact: dict, num_runs: int) -> float:
    """Chi-square over outputs, pooling those expected fewer than 5 times into one cell (left
    out when it expects nothing: a grammar makes many outputs impossible)."""
    impossible = sum(observed.get(s, 0) for s, p in exact.items() if p == 0.0)
    assert impossible == 0, "impossible output"
    assert sum(observed.values()) == num_runs
    expected, counts = [], []
    pooled_expected = pooled_count = 0.0
    for sequence, probability in exact.items():
        if probability * num_runs < 5:
            pooled_expected += probability * num_runs
            pooled_count += observed.get(sequence, 0)
        else:
            expected.append(probability * num_runs)
            counts.append(observed.get(sequence, 0))
    if pooled_expected > 0:
        expected.append(pooled_expected)
        counts.append(pooled_count)
    return stats.chisquare(counts, expected).pvalue


def _finishing_next(prefix: tuple[int, ...]) -> set[int] | None:
    """The tokens FINISHING allows after ``prefix``, written out by hand (None: finished)."""
    if 3 in prefix:
        return None
    return {2} if prefix and prefix[-1] == 1 else {0, 1, 3, 4}


def _open_next(prefix: tuple[int, ...]) -> set[int] | None:
    """The tokens OPEN allows after ``prefix`` (with STOP as the stop token)."""
    if STOP in prefix:
        return None
    if prefix and prefix[-1] == 1:
        return {2}
    return {0, 1} | ({STOP} if prefix else set())


@pytest.fixture(scope="module")
def small_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    directory = tmp_path_factory.mktemp("small_vocab_grammar")
    build_checkpoint("llama_mtp", directory)
    untie_lm_head(directory, logit_scale=2.0, vocab_size=SMALL_VOCAB)
    model = load(directory)
    draft = make_layer_skip_draft(model, 1)
    return Engine(model, draft_model=draft, max_num_seqs=MAX_CONCURRENT)


@pytest.fixture(scope="module")
def byte_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The 259-token byte-level fixture: room for real JSON."""
    directory = tmp_path_factory.mktemp("byte_grammar")
    build_checkpoint("llama_mtp", directory)
    untie_lm_head(directory, logit_scale=3.0)
    model = load(directory)
    return Engine(model, draft_model=make_layer_skip_draft(model, 1))


# -- the grammar state ------------------------------------------------------------------


def test_invalid_schema_and_regex_name_the_problem() -> None:
    with pytest.raises(InvalidParameter, match="Invalid type: foo") as caught:
        check_grammar(GrammarSpec.json_schema({"type": "foo"}))
    assert caught.value.param == "response_format"
    with pytest.raises(InvalidParameter, match="regex"):
        check_grammar(GrammarSpec("regex", "a(b", param="mtplx.regex"))
    with pytest.raises(InvalidParameter, match="must be an object"):
        GrammarSpec.json_schema([1, 2])
    with pytest.raises(InvalidParameter):
        check_grammar(GrammarSpec("lark", "start: nope"))


def test_a_grammar_that_admits_nothing_is_invalid(small_engine: Engine) -> None:
    compiler = GrammarCompiler(small_engine.tokenizer, SMALL_VOCAB)
    for spec in (
        GrammarSpec("regex", r"[^\s\S]", param="mtplx.regex"),
        GrammarSpec.json_schema({"$ref": "#"}),
    ):
        with pytest.raises(InvalidParameter, match="admits no output") as caught:
            compiler.state(spec, stop_ids={STOP})
        assert caught.value.param == spec.param
    empty = compiler.state(GrammarSpec("regex", "", param="mtplx.regex"), stop_ids={STOP})
    assert set(np.flatnonzero(empty.allowed())) == {STOP}  # "" is an answer: only stop


def test_a_grammar_over_the_size_limit_is_refused_before_any_work() -> None:
    spec = GrammarSpec("lark", "start: " + " | ".join(f'"t{i}"' for i in range(30_000)))
    assert len(spec.source) > MAX_GRAMMAR_CHARS
    with pytest.raises(InvalidParameter, match="at most") as caught:
        check_grammar(spec)
    assert caught.value.code == "grammar_too_large"


@pytest.mark.parametrize(
    "spec",
    [
        # Each nests one recursive-descent frame of llguidance's per link: a few thousand
        # overflow a default thread stack and kill the process with SIGSEGV.
        GrammarSpec(
            "lark",
            "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(5000)) + 'r5000: "x"\n',
        ),
        GrammarSpec.json_schema(
            {
                "$ref": "#/$defs/d0",
                "$defs": {
                    **{f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)},
                    "d3000": {"type": "string"},
                },
            }
        ),
    ],
    ids=["lark-chain", "defs-chain"],
)
def test_deeply_nested_grammars_compile_without_crashing(small_engine: Engine, spec) -> None:
    check_grammar(spec)
    GrammarCompiler(small_engine.tokenizer, SMALL_VOCAB).compile(spec)


@pytest.mark.parametrize("failure_point", ["grammar", "drafter", "emitter", "prefix"])
def test_a_request_that_fails_in_add_leaves_no_row_behind(
    small_engine: Engine, monkeypatch: pytest.MonkeyPatch, failure_point: str
) -> None:
    """Every way ``add`` can fail, as many times as there are rows: the batch still admits
    a full set of requests afterwards."""
    import mtplx.admission as admission_module

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected")

    engine = small_engine
    unsatisfiable = GenerationRequest(
        [1, 2], GREEDY, max_tokens=2, grammar=GrammarSpec("regex", r"[^\s\S]")
    )
    request = GenerationRequest([1, 2], GREEDY, max_tokens=2)
    with monkeypatch.context() as patch:
        if failure_point == "grammar":
            request = unsatisfiable
        elif failure_point == "drafter":
            patch.setitem(engine._drafters, engine.default_drafter, fail)
        elif failure_point == "emitter":
            patch.setattr(admission_module, "TextEmitter", fail)
        else:
            patch.setattr(engine, "prefix", type("Broken", (), {"reuse": fail})())
        for _ in range(engine.max_num_seqs + 1):
            with pytest.raises((InvalidParameter, RuntimeError)):
                engine.add(request)
    assert engine.num_orphan_rows == 0 and not engine.running
    sequences = [
        engine.add(GenerationRequest([1, 2], GREEDY, max_tokens=2))
        for _ in range(engine.max_num_seqs)
    ]
    for sequence in sequences:
        engine.abort(sequence)
    assert engine.num_orphan_rows == 0


def test_a_grammar_too_slow_to_compile_is_refused_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A schema whose compile time grows as a power of its size (pattern properties) is
    checked in a process of its own and refused once its time is up."""
    import mtplx.grammar

    monkeypatch.setattr(mtplx.grammar, "GRAMMAR_CHECK_SECONDS", 1.0)
    patterns = {f"^p{i}[a-z]*$": {"type": "integer"} for i in range(3000)}
    spec = GrammarSpec.json_schema({"type": "object", "patternProperties": patterns})
    with pytest.raises(InvalidParameter, match="too long to compile") as caught:
        check_grammar(spec)
    assert caught.value.code == "grammar_too_complex"
    # Large but quick grammars pass through the same process check (a limit no load reaches).
    monkeypatch.setattr(mtplx.grammar, "GRAMMAR_CHECK_SECONDS", 120.0)
    check_grammar(GrammarSpec("lark", "start: " + " | ".join(f'"t{i}"' for i in range(400))))


def test_a_prepared_request_is_added_without_waiting_for_the_grammar_thread(
    small_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prepare`` leaves everything ``add`` needs with the request: a flood of other
    grammars evicting it from the compiler's cache meanwhile does not make the engine
    thread compile again (behind every grammar queued on the grammar thread)."""
    import mtplx.grammar

    engine = small_engine
    spec = GrammarSpec("lark", 'start: "!" "#"', param="mtplx.grammar")
    request = GenerationRequest([1, 2], GREEDY, max_tokens=4, grammar=spec)
    engine.prepare(request)
    engine.grammars._compiled.clear()  # evicted by other requests' grammars
    mtplx.grammar._checked.clear()

    def no_grammar_thread(*args: object) -> None:
        raise AssertionError("the engine thread waited for the grammar thread")

    monkeypatch.setattr(mtplx.grammar, "_on_grammar_thread", no_grammar_thread)
    sequence = engine.add(request)
    try:
        assert sequence.grammar is not None
        assert spec == GrammarSpec("lark", 'start: "!" "#"', param="mtplx.grammar")
        assert hash(spec) == hash(GrammarSpec("lark", 'start: "!" "#"', param="mtplx.grammar"))
    finally:
        engine.abort(sequence)


def test_a_token_the_parser_refuses_fails_plainly(small_engine: Engine) -> None:
    """What the matcher refuses while decoding (its parser limits; here a token no mask
    offered) fails the request with an error naming the field, on one bounded line: no
    parser state, no grammar."""
    compiler = GrammarCompiler(small_engine.tokenizer, SMALL_VOCAB)
    state = compiler.state(GrammarSpec("lark", OPEN.source, param="mtplx.grammar"), {STOP})
    with pytest.raises(InvalidParameter) as caught:
        state.consume(5)
    message = str(caught.value)
    assert caught.value.param == "mtplx.grammar" and caught.value.code == "grammar_too_complex"
    assert "\n" not in message and "<state>" not in message and len(message) < 500


@pytest.mark.parametrize("count", [300_000, 1_000_000])
def test_a_grammar_past_the_lexers_budget_is_refused_before_admission(
    small_engine: Engine, count: int
) -> None:
    """A repetition whose first mask leaves the shared lexer's expression budget spent: the
    compile refuses it (one bounded line naming the field), where every request's first
    mask would fail."""
    compiler = GrammarCompiler(small_engine.tokenizer, SMALL_VOCAB)
    spec = GrammarSpec("regex", f"!{{{count}}}", param="mtplx.regex")
    with pytest.raises(InvalidParameter, match="parser's limits") as caught:
        compiler.state(spec, stop_ids={STOP})
    assert caught.value.param == "mtplx.regex" and caught.value.code == "grammar_too_complex"
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 500


def test_a_mask_the_parser_fails_is_an_error_not_the_end_of_the_text(
    small_engine: Engine,
) -> None:
    """A matcher its mask put in error allows nothing, which is not a complete text: the
    state is not ``finished`` (which ended the reply with an empty text and finish_reason
    "stop"), and the row's next commit (``consume`` or ``rollback``) fails with
    grammar_too_complex. ``allowed`` itself answers None: it runs for a whole batch."""
    from llguidance import LLMatcher, LLParserLimits

    from mtplx.grammar import GrammarState

    compiler = GrammarCompiler(small_engine.tokenizer, SMALL_VOCAB)
    spec = GrammarSpec("regex", "!{1000000}", param="mtplx.regex")
    limits = LLParserLimits(verbose_errors=False)
    matcher = LLMatcher(compiler._llguidance_tokenizer(), check_grammar(spec), limits=limits)
    matcher.deep_copy().compute_bitmask()  # the compile's probe: the budget now spent
    state = GrammarState(matcher.deep_copy(), SMALL_VOCAB, {STOP}, [], param="mtplx.regex")
    assert state.allowed() is None and not state.finished
    commits = (lambda: state.consume(0), lambda: state.consume(STOP), lambda: state.rollback(1))
    for commit in commits:
        with pytest.raises(InvalidParameter, match="parser's limits") as caught:
            commit()
        assert caught.value.param == "mtplx.regex" and caught.value.code == "grammar_too_complex"


def test_state_masks_stop_tokens_and_rollback(small_engine: Engine) -> None:
    compiler = GrammarCompiler(small_engine.tokenizer, SMALL_VOCAB)
    state = compiler.state(OPEN, stop_ids={STOP, IM_END_ID})
    assert set(np.flatnonzero(state.allowed())) == {0, 1}  # not complete: no stop token
    state.consume(0)
    assert set(np.flatnonzero(state.allowed())) == {0, 1, STOP}
    state.consume(1)
    assert set(np.flatnonzero(state.allowed())) == {2}
    state.consume(2)
    state.consume(STOP)
    assert state.finished and state.allowed() is None
    state.rollback(3)  # back to after "!"
    assert not state.finished and state.num_consumed == 1
    assert set(np.flatnonzero(state.allowed())) == {0, 1, STOP}
    with pytest.raises(ValueError, match="failed at token 5"):
        state.consume(5)


def test_a_complete_grammar_with_no_continuation_is_finished(small_engine: Engine) -> None:
    state = GrammarCompiler(small_engine.tokenizer, SMALL_VOCAB).state(FINISHING, stop_ids=())
    assert set(np.flatnonzero(state.allowed())) == {0, 1, 3, 4}
    state.consume(3)
    assert state.finished and state.allowed() is None


# -- exact under speculation ------------------------------------------------------------


def _exact_constrained(
    engine: Engine,
    prompt: list[int],
    config: SamplerConfig,
    allowed_after,
    max_tokens: int = NUM_GENERATED,
) -> dict[tuple[int, ...], float]:
    """P(output) of plain constrained decoding of up to ``max_tokens`` tokens, enumerated:
    p masked to the grammar's tokens and renormalised at every position; a path ends when the
    grammar finishes (the stop token, if any, is not an output token)."""
    done: dict[tuple[int, ...], float] = {}
    prefixes = {(): 1.0}
    for _position in range(max_tokens):
        next_prefixes = {}
        for prefix, mass in prefixes.items():
            allowed = allowed_after(prefix)
            if allowed is None:
                output = prefix[:-1] if prefix and prefix[-1] == STOP else prefix
                done[output] = done.get(output, 0.0) + mass
                continue
            mask = np.isin(np.arange(SMALL_VOCAB), sorted(allowed))
            logits = np.array(_next_logits_from_history(engine.model, prompt + list(prefix)))
            counts = np.bincount(np.array(prefix, dtype=int), minlength=SMALL_VOCAB)
            probs = distribution_from_logits(logits.astype(np.float64), config, counts, mask)
            assert probs[~mask].sum() == 0.0
            for token in np.flatnonzero(probs):
                next_prefixes[(*prefix, int(token))] = mass * probs[token]
        prefixes = next_prefixes
    for prefix, mass in prefixes.items():
        output = prefix[:-1] if prefix[-1] == STOP else prefix
        done[output] = done.get(output, 0.0) + mass
    assert math.isclose(sum(done.values()), 1.0, rel_tol=1e-9)
    every = [t for n in range(max_tokens + 1) for t in itertools.product(range(12), repeat=n)]
    return {sequence: done.get(sequence, 0.0) for sequence in every}


# 1,500 seeded runs a case, decoded concurrently: the default tier keeps the lookup-first
# case (both drafters of a mix, a grammar that finishes) beside the negative control below;
# the others run in `make test-slow`.
@pytest.mark.parametrize(
    "drafter, config, grammar",
    [
        pytest.param("none", SamplerConfig(temperature=0.8), "finishing", id="plain", marks=SLOW),
        pytest.param(
            "mtp", SamplerConfig(temperature=0.9, top_k=3), "finishing", id="mtp-topk", marks=SLOW
        ),
        pytest.param(
            "draft_model",
            SamplerConfig(temperature=1.0, presence_penalty=0.7),
            "open",
            id="draft-penalty",
            marks=SLOW,
        ),
        pytest.param("ngram", SamplerConfig(temperature=0.7), "open", id="ngram", marks=SLOW),
        pytest.param(
            "mtp+ngram",
            SamplerConfig(temperature=0.9, top_p=0.9),
            "finishing",
            id="lookup-first-topp",
        ),
    ],
)
def test_constrained_sampling_follows_plain_constrained_decoding(
    small_engine: Engine, drafter: str, config: SamplerConfig, grammar: str
) -> None:
    prompt = [0, 1, 2, 0, 1] if grammar == "finishing" else [0, 1, 2, 0, 1, 2, 0]
    spec, allowed_after = (
        (FINISHING, _finishing_next) if grammar == "finishing" else (OPEN, _open_next)
    )
    exact = _exact_constrained(small_engine, prompt, config, allowed_after)
    requests = [
        GenerationRequest(
            prompt,
            SamplerConfig(**{**config.__dict__, "seed": run, "logit_bias": {}}),
            max_tokens=NUM_GENERATED,
            drafter=drafter,
            depth=2,
            ignore_eos=True,
            stop_token_ids=(STOP,) if grammar == "open" else (),
            grammar=spec,
            close_within_budget=False,  # the grammar alone (the budget rule: below)
        )
        for run in range(NUM_RUNS)
    ]
    observed = sample_counts(small_engine, requests)
    assert _chi_square_pvalue(observed, exact, NUM_RUNS) > SIGNIFICANCE


def _quoted_next(prefix: tuple[int, ...]) -> set[int] | None:
    """The tokens QUOTED allows after ``prefix`` under the budget rule with a margin of 1
    and NUM_GENERATED + 1 tokens: the closing (``""`` before the opening quote, ``"``
    inside) must fit in the tokens left, or only its first character may come."""
    if len(prefix) >= 2 and prefix[-1] == 1:
        return None  # closed: nothing may follow
    allowed, closing = ({1}, 2) if not prefix else ({0, 1, 2, 4}, 1)
    left = NUM_GENERATED + 1 - len(prefix)
    return allowed & {1} if left <= closing + 1 else allowed


@pytest.mark.parametrize(
    "drafter, config",
    [("none", SamplerConfig(temperature=0.9)), ("mtp", SamplerConfig(temperature=1.0))],
    ids=["plain", "mtp"],
)
def test_the_budget_rule_is_exact_and_closes_the_text(
    small_engine: Engine, monkeypatch: pytest.MonkeyPatch, drafter: str, config: SamplerConfig
) -> None:
    """Sampling under the budget rule follows the exact enumeration of plain decoding
    with the rule's masks, for every drafter; and every output parses (the rule closed the
    string within max_tokens)."""
    import mtplx.grammar_budget

    monkeypatch.setattr(mtplx.grammar_budget, "CLOSING_MARGIN", 1)
    prompt = [0, 1, 2, 0, 1]
    max_tokens = NUM_GENERATED + 1
    exact = _exact_constrained(small_engine, prompt, config, _quoted_next, max_tokens)
    requests = [
        GenerationRequest(
            prompt,
            SamplerConfig(**{**config.__dict__, "seed": run}),
            max_tokens=max_tokens,
            drafter=drafter,
            depth=2,
            ignore_eos=True,
            grammar=QUOTED,
        )
        for run in range(NUM_RUNS)
    ]
    observed = sample_counts(small_engine, requests)
    for tokens in observed:
        assert tokens[0] == tokens[-1] == 1 and len(tokens) >= 2, tokens  # a closed string
    assert _chi_square_pvalue(observed, exact, NUM_RUNS) > SIGNIFICANCE


def test_the_chi_square_sees_an_unconstrained_sampler(small_engine: Engine) -> None:
    """Negative control: unconstrained samples fail against the constrained enumeration."""
    prompt = [0, 1, 2, 0, 1]
    config = SamplerConfig(temperature=0.8)
    exact = _exact_constrained(small_engine, prompt, config, _finishing_next)
    requests = [
        GenerationRequest(
            prompt, SamplerConfig(temperature=0.8, seed=run), NUM_GENERATED, ignore_eos=True
        )
        for run in range(300)
    ]
    observed = sample_counts(small_engine, requests)
    with pytest.raises(AssertionError, match="impossible output"):
        _chi_square_pvalue(observed, exact, 300)


def _encode(engine: Engine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


def _tokens(engine: Engine, request: GenerationRequest) -> tuple[list[int], str]:
    events = list(engine.generate(request))
    finish = events[-1]
    assert isinstance(finish, FinishEvent)
    return [e.token_id for e in events if isinstance(e, TokenEvent)], finish.finish_reason


SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"enum": ["xy", "zw"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def _reference_greedy(
    engine: Engine, prompt: list[int], spec: GrammarSpec, limit: int
) -> list[int]:
    """Plain constrained greedy decoding written out: logits of the history, the grammar's
    allowed tokens (with the budget rule for ``limit`` tokens, as requests have it), argmax."""
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size)
    state = compiler.state(spec, engine.eos_token_ids, budget=limit)
    tokens: list[int] = []
    while len(tokens) < limit:
        allowed = state.allowed()
        if allowed is None:
            break
        logits = np.array(_next_logits_from_history(engine.model, prompt + tokens))
        token = int(np.argmax(np.where(allowed, logits, -np.inf)))
        if token in engine.eos_token_ids:
            break
        state.consume(token)
        tokens.append(token)
    return tokens


@pytest.mark.parametrize("spec", [GrammarSpec.json_schema(SCHEMA), GrammarSpec.json_object()])
def test_greedy_constrained_output_is_the_same_for_every_drafter(
    byte_engine: Engine, spec: GrammarSpec
) -> None:
    prompt = _encode(byte_engine, '{"a": 1, "b": "xy"} {"a": 2, "b": "zw"} ')
    reference = _reference_greedy(byte_engine, prompt, spec, 40)
    for drafter in DRAFTERS:
        for depth in (None, 1, 3) if drafter != "none" else (0,):
            request = GenerationRequest(
                prompt, GREEDY, max_tokens=40, drafter=drafter, depth=depth, grammar=spec
            )
            tokens, reason = _tokens(byte_engine, request)
            assert tokens == reference, (drafter, depth)
    text = byte_engine.tokenizer.decode(reference)
    if reason == "stop":
        parsed = json.loads(text)
        assert isinstance(parsed, dict)
        if spec.kind == "json_schema":
            assert set(parsed) == {"a", "b"} and parsed["b"] in ("xy", "zw")


def test_constrained_rows_in_a_batch_equal_their_solo_runs(byte_engine: Engine) -> None:
    """Greedy and seeded rows, constrained or not, in one batch: each equals its solo run;
    the unconstrained ones equal their runs in a batch without any grammar."""
    texts = ['{"a": 3, "b": "xy"} ', "hello hello hello ", "[1, 2] [1, 2"]
    prompts = [_encode(byte_engine, text) for text in texts]
    spec = GrammarSpec.json_schema(SCHEMA)
    requests = []
    for index, drafter in enumerate(DRAFTERS * 2):
        config = GREEDY if index % 2 == 0 else SamplerConfig(temperature=0.8, seed=index)
        grammar = spec if index % 3 != 2 else None
        depth = 0 if drafter == "none" else 1 + index % 3
        requests.append(
            GenerationRequest(
                prompts[index % 3], config, 24, drafter=drafter, depth=depth, grammar=grammar
            )
        )
    solo = [_tokens(byte_engine, request)[0] for request in requests]
    together, last = run_batch(byte_engine, requests)
    assert together == solo
    assert all(isinstance(event, FinishEvent) for event in last)
    free = [r for r in requests if r.grammar is None]
    free_batch, _ = run_batch(byte_engine, free)
    assert free_batch == [t for t, r in zip(solo, requests, strict=True) if r.grammar is None]


def test_a_finished_grammar_ends_the_sequence_with_stop(small_engine: Engine) -> None:
    request = GenerationRequest(
        [0, 1], GREEDY, max_tokens=50, drafter="mtp", depth=3, ignore_eos=True, grammar=FINISHING
    )
    tokens, reason = _tokens(small_engine, request)
    assert reason == "stop" and tokens[-1] == 3 and 3 not in tokens[:-1]


def test_regex_grammar(small_engine: Engine) -> None:
    spec = GrammarSpec("regex", '(!")+#')
    request = GenerationRequest(
        [0, 1], GREEDY, max_tokens=50, drafter="ngram", depth=3, grammar=spec
    )
    tokens, reason = _tokens(small_engine, request)
    body = tokens[:-1] if reason == "stop" else tokens
    assert body == [0, 1] * (len(body) // 2) and (reason == "length" or tokens[-1] == 2)
