"""The engine: owns a loaded model and all MLX work, on one thread.

``generate`` runs prefill, then the step loop — choose a depth, run one draft / verify /
accept / commit cycle (``mtplx.speculative.run_cycle``), emit the committed tokens — until a
stop condition. Closing the generator cancels the request between cycles.
"""

from __future__ import annotations

import logging
import secrets
import statistics
import time
from collections.abc import Iterator

import mlx.core as mx

from mtplx.depth_policy import AdaptiveDepth
from mtplx.drafters import (
    Drafter,
    DraftModelDrafter,
    LookupFirstDrafter,
    MTPDrafter,
    NgramDrafter,
)
from mtplx.drafters.base import DraftSampler
from mtplx.drafters.lookup_first import LOOKUP
from mtplx.drafters.ngram import LONG_MATCH, find_continuation, one_hot_proposals
from mtplx.models.base import LoadedModel, TargetModel
from mtplx.output import TextEmitter
from mtplx.request import FinishEvent, GenerationRequest, GenerationStats, TokenEvent
from mtplx.sampling import SamplerConfig, mx_distribution_from_logits, mx_sample
from mtplx.speculative import (
    Ahead,
    CycleResult,
    SequenceState,
    close_ahead,
    cycle_uniforms,
    plain_cycle_ahead,
    run_cycle,
)

logger = logging.getLogger(__name__)

# Lookup cycles whose match is LONG_MATCH tokens or more, a copy of earlier text, get their
# own depth policy: their acceptance is high (see mtplx.drafters.ngram), that of short
# matches (common phrases) low, so one estimate for both would fit neither.
LONG_LOOKUP = "ngram-long"

# Prior acceptance per depth policy, before a request has measured its own: for a model
# drafter, what the shipped head achieves at position 1 on the bench's chat and code prompts
# (0.25-0.31; 0.49 on prompts like its training data), which does not pay on a CPU, so a
# request drafts only once its own counts show it pays; for copied text, what lookup
# achieves there, so a request starts drafting on the first long match.
PRIOR_ACCEPTANCE = {"mtp": 0.3, "draft_model": 0.3, LOOKUP: 0.3, LONG_LOOKUP: 0.8}


class Engine:
    """Speculative generation over one loaded model. Not thread-safe: one thread uses it."""

    def __init__(
        self,
        model: LoadedModel,
        *,
        default_drafter: str | None = None,
        default_depth: int | None = None,
        draft_model: TargetModel | None = None,
        max_adaptive_depth: int = 5,
        prefill_chunk_size: int = 512,
    ) -> None:
        self.model = model
        self.target = model.target
        self.tokenizer = model.tokenizer
        self.model_name = model.path.name
        self.context_length = model.context_length
        self.vocab_size = model.target.vocab_size
        self.max_adaptive_depth = max_adaptive_depth
        self.prefill_chunk_size = prefill_chunk_size
        self._drafters: dict[str, Drafter | None] = {"none": None, "ngram": NgramDrafter()}
        if model.mtp_heads:
            self._drafters["mtp"] = MTPDrafter(model)
        if draft_model is not None:
            if draft_model.vocab_size != self.vocab_size:
                raise ValueError(
                    f"draft model vocabulary ({draft_model.vocab_size}) differs from the "
                    f"target's ({self.vocab_size})"
                )
            self._drafters["draft_model"] = DraftModelDrafter(draft_model)
        lookup = self._drafters["ngram"]
        for name in ("mtp", "draft_model"):
            model_drafter = self._drafters.get(name)
            if model_drafter is not None:
                mixed = LookupFirstDrafter(lookup, model_drafter)  # type: ignore[arg-type]
                self._drafters[f"{name}+ngram"] = mixed
        self.available_drafters = tuple(self._drafters)
        if default_drafter is None:  # the best drafter this model has
            default_drafter = next(
                d for d in ("mtp+ngram", "draft_model+ngram", "ngram") if d in self._drafters
            )
        if default_drafter not in self._drafters:
            raise ValueError(
                f"drafter {default_drafter!r} is not available for {self.model_name}; "
                f"available: {', '.join(self.available_drafters)}"
            )
        self.default_drafter = default_drafter
        self.default_depth = default_depth
        self._cycle_costs: dict[tuple[str, tuple[bool, ...]], list[float]] = {}
        self.eos_token_ids = set(model.eos_token_ids) | set(
            getattr(self.tokenizer, "eos_token_ids", set()) or set()
        )

    # -- request checks ---------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """Raise ValueError naming the field before any work if ``request`` cannot run."""
        drafter = request.drafter or self.default_drafter
        if drafter not in self._drafters:
            raise ValueError(
                f"drafter {drafter!r} is not available for {self.model_name}; "
                f"available: {', '.join(self.available_drafters)}"
            )
        num_prompt = len(request.prompt_ids)
        if num_prompt >= self.context_length:
            raise ValueError(
                f"prompt is {num_prompt} tokens, over the context length {self.context_length}"
            )
        bad = [t for t in request.prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary")
        bad = [t for t in request.sampler.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary")
        bad = [t for t in request.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary")

    def token_text(self, token_id: int) -> str:
        """Text of one token (for top logprobs)."""
        return self.tokenizer.decode([token_id])

    # -- generation -------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> Iterator[TokenEvent | FinishEvent]:
        """Yield a TokenEvent per committed token, then one FinishEvent."""
        self.validate(request)
        config = request.sampler
        drafter_name = request.drafter or self.default_drafter
        drafter = self._drafters[drafter_name]
        depth = request.depth if request.depth is not None else self.default_depth
        sources = _sources(drafter)
        policies = {}  # draft source -> its adaptive depth policy (empty: fixed depth)
        if depth is None and drafter is not None:
            policies = {
                source: AdaptiveDepth(
                    self.cycle_costs(_cost_source(source), config),
                    prior_acceptance=PRIOR_ACCEPTANCE[source],
                )
                for source in sources
            }
        seed = config.seed if config.seed is not None else secrets.randbits(63)
        prompt = [int(t) for t in request.prompt_ids]
        state = SequenceState(
            tokens=list(prompt),
            num_prompt_tokens=len(prompt),
            cache=self.target.make_cache(),
            seed=seed,
            token_counts=mx.zeros((self.vocab_size,), mx.int32) if config.has_penalties else None,
        )
        stats = GenerationStats(prompt_tokens=len(prompt))
        emitter = TextEmitter(self.tokenizer.detokenizer, request.stop)
        stop_ids = set(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= self.eos_token_ids

        started = time.perf_counter()
        first = self._prefill(state, drafter, request)
        stats.prefill_time = time.perf_counter() - started
        pending: CycleResult | None = first
        ahead: Ahead | None = None  # the queued forward of state.tokens[-1], if any
        planned: tuple[str | None, int] | None = None  # a drafting cycle waiting on close_ahead
        while True:
            for index, token in enumerate(pending.committed):
                state.tokens.append(token)
                stats.completion_tokens += 0 if token in stop_ids else 1
                if token in stop_ids:
                    yield FinishEvent("stop", stats, emitter.flush())
                    return
                text = emitter.add(token)
                yield self._token_event(pending, index, token, text, request.logprobs)
                if emitter.stopped:
                    yield FinishEvent("stop", stats)
                    return
                if state.num_output_tokens >= request.max_tokens:
                    yield FinishEvent("length", stats, emitter.flush())
                    return
            if state.token_counts is not None:
                committed = mx.array(pending.committed, mx.int32)
                state.token_counts = state.token_counts.at[committed].add(1)
            room = min(
                request.max_tokens - state.num_output_tokens,
                self.context_length - len(state.tokens),
            )
            if room <= 0:
                yield FinishEvent("length", stats, emitter.flush())
                return
            source, num_draft = planned or _plan_cycle(
                drafter, policies, depth, state.tokens, room - 1
            )
            num_draft, planned = min(num_draft, room - 1), None
            if num_draft > 0 and ahead is not None:
                # Commit the queued forward's token first, then draft after it as planned.
                pending, ahead, planned = close_ahead(drafter, ahead), None, (source, num_draft)
            else:
                pending, ahead = self._cycle(state, drafter, config, num_draft, ahead)
                if source in policies and num_draft > 0:
                    policies[source].update(pending.num_drafted, pending.num_accepted)
            _record(stats, pending)

    def _cycle(
        self,
        state: SequenceState,
        drafter: Drafter | None,
        config: SamplerConfig,
        num_draft: int,
        ahead: Ahead | None,
    ) -> tuple[CycleResult, Ahead | None]:
        """One cycle; plain ones run a step ahead (see ``mtplx.speculative``) unless
        penalties need the counts of each committed token first. A drafting cycle needs
        ``ahead`` closed (``close_ahead``) first."""
        if num_draft == 0 and not config.has_penalties:
            return plain_cycle_ahead(self.target, drafter, state, config, ahead)
        if ahead is not None:
            raise RuntimeError("a drafting cycle cannot start with a forward still queued")
        return run_cycle(self.target, drafter, state, config, num_draft), None

    def _prefill(
        self, state: SequenceState, drafter: Drafter | None, request: GenerationRequest
    ) -> CycleResult:
        """Run the prompt through the target in chunks and sample the first token."""
        prompt = state.tokens
        hiddens = []
        for start in range(0, len(prompt), self.prefill_chunk_size):
            chunk = mx.array(prompt[start : start + self.prefill_chunk_size], mx.int32)[None]
            logits, hidden = self.target(chunk, state.cache)
            if drafter is not None and drafter.needs_hidden:
                hiddens.append(hidden)
            mx.eval(logits, hiddens)
        last_logits = logits[0, -1:]
        probs = mx_distribution_from_logits(
            last_logits,
            request.sampler,
            None if state.token_counts is None else state.token_counts[None],
        )
        uniform = cycle_uniforms(state.seed, len(prompt), 0)
        token = int(mx_sample(probs, uniform).item())
        if drafter is not None:
            drafter.reset(prompt)
            target_hidden = mx.concatenate(hiddens, axis=1) if hiddens else None
            drafter.commit([*prompt[1:], token], target_hidden)
        return CycleResult([token], 0, 0, last_logits, 0.0, 0.0)

    def _token_event(
        self, result: CycleResult, index: int, token: int, text: str, logprobs: int | None
    ) -> TokenEvent:
        drafted = index < result.num_accepted
        if logprobs is None:
            return TokenEvent(token, text, drafted)
        logits = result.target_logits[index].astype(mx.float32)
        log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        top: tuple[tuple[int, float], ...] = ()
        if logprobs > 0:
            top_ids = mx.argpartition(-log_probs, kth=logprobs - 1)[:logprobs]
            pairs = zip(top_ids.tolist(), log_probs[top_ids].tolist(), strict=True)
            top = tuple(sorted(pairs, key=lambda pair: -pair[1]))
        return TokenEvent(token, text, drafted, float(log_probs[token].item()), top)

    # -- cost calibration for the adaptive depth policy --------------------------------------

    def warm_up(
        self, configs: tuple[SamplerConfig, ...] = (SamplerConfig(temperature=0.0), SamplerConfig())
    ) -> None:
        """Measure the adaptive policy's cycle costs for the default drafter under
        ``configs`` (greedy and the OpenAI default sampling), so that requests do not wait
        for it. Other kinds of sampling are measured when first used."""
        if self.default_depth is not None:
            return
        sources = _sources(self._drafters[self.default_drafter])
        for source in dict.fromkeys(_cost_source(source) for source in sources):
            for config in configs:
                self.cycle_costs(source, config)

    def cycle_costs(self, source: str, config: SamplerConfig) -> list[float]:
        """Seconds of one cycle at depth 0..max_adaptive_depth drafting from ``source``
        under ``config``'s kind of sampling (greedy or not, which filters, penalties),
        measured once per engine and kind (median of repeats) and then fixed, so a seeded
        request replays the same depth schedule within a process."""
        key = (source, _sampling_kind(config))
        if key not in self._cycle_costs:
            self._cycle_costs[key] = self._measure_cycle_costs(source, config)
            logger.info(
                "cycle costs for %s %s: %s ms",
                source,
                key[1],
                [round(c * 1e3, 2) for c in self._cycle_costs[key]],
            )
        return self._cycle_costs[key]

    def _measure_cycle_costs(
        self, source: str, config: SamplerConfig, rounds: int = 4
    ) -> list[float]:
        """Time whole cycles (draft, verify forward, the exact rule, host syncs, commits) at
        each depth on a scratch sequence, every drafting cycle drafting its full depth.

        Plain cycles are timed in a queued steady state; drafting ones as the engine runs
        them, after the close of the queued forward and with the plain cycles that restore
        it (below). Each round times every depth against its own plain cycles, so a slow
        spell of the machine (a shared host's is +-15%) weighs on all depths of a round
        alike. A drafting cycle's cost grows with its depth by about one draft step and
        one verify row a token, so the drafting costs are the least-squares line through
        the per-depth medians: noise in one depth can then neither make it look cheaper than
        a shallower one nor, floored to it, make the deeper one look free."""
        drafter = self._drafters[source]
        if source == LOOKUP:
            # What the target writes after a scratch prompt soon stops matching it, and a
            # lookup that finds no match drafts nothing: it would be timed as a plain cycle.
            drafter = ScratchLookup()
        prompt = [(7 + i % 8) % self.vocab_size for i in range(32)]
        state = SequenceState(
            tokens=list(prompt),
            num_prompt_tokens=len(prompt),
            cache=self.target.make_cache(),
            seed=0,
            token_counts=mx.zeros((self.vocab_size,), mx.int32) if config.has_penalties else None,
        )
        scratch = GenerationRequest(prompt_ids=prompt, sampler=config)
        state.tokens.extend(self._prefill(state, drafter, scratch).committed)
        ahead = None

        def timed_cycle(depth: int) -> float:
            nonlocal ahead
            started = time.perf_counter()
            if depth and ahead is not None:
                state.tokens.extend(close_ahead(drafter, ahead).committed)
                ahead = None
            result, ahead = self._cycle(state, drafter, config, depth, ahead)
            state.tokens.extend(result.committed)
            return time.perf_counter() - started

        for _ in range(2):  # the queued work of the prefill, and warm-up
            timed_cycle(0)
        depths = range(1, self.max_adaptive_depth + 1)
        plains: list[float] = []
        excess: list[list[float]] = [[] for _ in depths]
        for _ in range(rounds):
            plain = statistics.median(timed_cycle(0) for _ in range(3))
            plains.append(plain)
            for depth in depths:
                # The close commits a plain token, and the plain cycles after a drafting one
                # start unqueued: time the three with it and charge the excess over three
                # queued plain cycles.
                span = timed_cycle(depth) + timed_cycle(0) + timed_cycle(0)
                excess[depth - 1].append(span - 3 * plain)
        plain = statistics.median(plains)
        medians = [statistics.median(spans) for spans in excess]
        if len(medians) < 2:
            return [plain, *(max(m, plain) for m in medians)]
        slope, intercept = statistics.linear_regression(depths, medians)
        return [plain, *(max(intercept + max(slope, 0.0) * k, plain) for k in depths)]


class ScratchLookup(NgramDrafter):
    """Prompt lookup for cost calibration: drafts k one-hot tokens every cycle (the history's
    last k tokens when it has no n-gram match), so a lookup cycle of depth k is timed as one."""

    def propose(
        self, history: list[int], k: int, sample: DraftSampler
    ) -> tuple[list[mx.array], list[mx.array]]:
        """Lookup's proposals, padded from the end of the history to k tokens."""
        continuation = find_continuation(history, k, self.max_ngram, self.min_ngram)
        missing = k - len(continuation)
        padding = history[-missing:] if missing > 0 else []
        return one_hot_proposals(continuation + padding, sample.vocab_size)


def _sampling_kind(config: SamplerConfig) -> tuple[bool, ...]:
    """What makes a cycle's sampling work differ: greedy, each filter, penalties, bias."""
    return (
        config.is_greedy,
        config.top_k > 0,
        config.top_p < 1.0,
        config.min_p > 0.0,
        config.has_penalties,
        bool(config.logit_bias),
    )


def _sources(drafter: Drafter | None) -> tuple[str, ...]:
    """The depth policy keys of a drafter: one per draft source, and lookup's split by match
    length (see ``_plan_cycle``)."""
    if drafter is None:
        return ()
    if isinstance(drafter, LookupFirstDrafter):
        return (LOOKUP, LONG_LOOKUP, drafter.model_drafter.name)
    if isinstance(drafter, NgramDrafter):
        return (LOOKUP, LONG_LOOKUP)
    return (drafter.name,)


def _cost_source(source: str) -> str:
    """The draft source whose measured cycle costs a depth policy key uses."""
    return LOOKUP if source == LONG_LOOKUP else source


def _plan_cycle(
    drafter: Drafter | None,
    policies: dict[str, AdaptiveDepth],
    depth: int | None,
    history: list[int],
    limit: int,
) -> tuple[str | None, int]:
    """(depth policy key, number of draft tokens) for the next cycle, at most ``limit``
    tokens. Prompt lookup drafts when the history has an n-gram match and the policy for that
    kind of match (long: a copy of earlier text, or short) gives a depth above 0; otherwise a
    lookup-first drafter drafts from its model drafter and plain lookup does not draft."""
    if drafter is None:
        return None, 0

    def depth_for(source: str) -> int:
        if policies:
            return policies[source].choose(limit)
        return min(depth or 0, limit)

    lookup = drafter.lookup if isinstance(drafter, LookupFirstDrafter) else drafter
    if isinstance(lookup, NgramDrafter) and (match := lookup.match_length(history)):
        source = LONG_LOOKUP if match >= LONG_MATCH else LOOKUP
        if (num_draft := depth_for(source)) > 0:
            if isinstance(drafter, LookupFirstDrafter):
                drafter.use(LOOKUP)
            return source, num_draft
    if isinstance(drafter, NgramDrafter):
        return None, 0
    if isinstance(drafter, LookupFirstDrafter):
        drafter.use(drafter.model_drafter.name)
        return drafter.model_drafter.name, depth_for(drafter.model_drafter.name)
    return drafter.name, depth_for(drafter.name)


def _record(stats: GenerationStats, result: CycleResult) -> None:
    """Add one cycle to the request's counters."""
    stats.num_cycles += 1
    stats.draft_time += result.draft_time
    stats.verify_time += result.verify_time
    if result.num_drafted == 0:
        return
    stats.num_drafts += 1
    stats.num_draft_tokens += result.num_drafted
    stats.num_accepted_tokens += result.num_accepted
    for counts, limit in (
        (stats.drafted_per_position, result.num_drafted),
        (stats.accepted_per_position, result.num_accepted),
    ):
        counts.extend([0] * (limit - len(counts)))
        for position in range(limit):
            counts[position] += 1
    if result.num_accepted < result.num_drafted:
        stats.num_recovered += 1
    else:
        stats.num_bonus += 1
