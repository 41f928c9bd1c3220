"""What several draft candidates at position 1 would buy (a static tree), measured offline:
``python -m mtplx.train.multi_draft --prompts benchmarks``.

With a weak first guess, a verify forward can carry several candidates for draft position 1
(the root's children of a tree, one tree-attention forward). Three exact acceptance rules
for one position with target distribution p and the head's distribution q (both after the
same sampler), each keeping the output distribution p:

- chain: one draft x ~ q, accepted with probability min(1, p(x)/q(x)):
  P = sum(min(p, q)).
- recursive rejection over k drafts drawn i.i.d. from q (SpecInfer / SpecTr): draft i is
  tested against r_{i-1}, the residual the earlier rejections left (r_0 = p,
  r_i = norm(max(r_{i-1} - q, 0)), the same whichever token was rejected), and the output
  after k rejections is drawn from r_k: P = 1 - prod_i (1 - sum(min(r_{i-1}, q))).
- fixed candidates (the head's top k, a static tree): each is a one-hot draft tested in turn
  against the residual (r(c) for candidate c; a rejection zeroes c and renormalises):
  P = sum of p over the candidates. At temperature 0: whether the target's token is among
  them.

``estimate`` measures these on real text: it generates each prompt's answer by plain
decoding at the sampler, runs the target once over prompt + answer and the head once,
teacher-forced on (h[m], x[m+1]) (what ``MTPDrafter`` feeds; ``mtplx.train.compare`` shows
the engine drafts exactly these), and averages P over the answer's positions.
``verify_costs`` times one row's forward over n tokens, so that a candidate count's
expected tokens per forward, 1 + P, can be set against what its forward costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mtplx.models.base import LoadedModel
from mtplx.request import SamplerConfig
from mtplx.sampling.reference import distribution_from_logits, sample_from_distribution


def _residual(r: np.ndarray, q: np.ndarray) -> np.ndarray | None:
    """norm(max(r - q, 0)), or None when no mass is left (r <= q everywhere: r == q)."""
    left = np.maximum(r - q, 0.0)
    total = left.sum()
    return left / total if total > 0 else None


def chain_acceptance(p: np.ndarray, q: np.ndarray) -> float:
    """P(one draft x ~ q is accepted): sum(min(p, q)). p, q: [V]."""
    return float(np.minimum(p, q).sum())


def recursive_rejection_acceptance(p: np.ndarray, q: np.ndarray, k: int) -> float:
    """P(one of k drafts drawn i.i.d. from q is accepted) under recursive rejection. p, q: [V]."""
    rejected_all = 1.0
    r: np.ndarray | None = p
    for _ in range(k):
        if r is None:  # the residual is empty: the last test accepted with certainty
            return 1.0
        rejected_all *= 1.0 - float(np.minimum(r, q).sum())
        r = _residual(r, q)
    return 1.0 - rejected_all


def top_k_acceptance(p: np.ndarray, scores: np.ndarray, k: int) -> float:
    """P(one of the k highest-scoring tokens is accepted, each a one-hot draft): the mass p
    puts on them. p: [V]; scores: [V] the head's logits (-inf outside its vocabulary); ties
    go to the lower token id."""
    candidates = np.argsort(-scores, kind="stable")[:k]
    return float(p[candidates].sum())


def recursive_rejection_sample(
    p: np.ndarray, drafts: list[np.ndarray], tokens: list[int], uniforms: np.ndarray
) -> tuple[int, int | None]:
    """The reference rule: draft i (token ``tokens[i]`` drawn from ``drafts[i]``, [V]) is
    accepted with probability min(1, r(x)/q_i(x)) against the residual r left by drafts
    before it; after every rejection the token is drawn from r. uniforms: [len(tokens) + 1].
    Returns (token, index of the accepted draft or None)."""
    r = p.astype(np.float64)
    for index, (q, token) in enumerate(zip(drafts, tokens, strict=True)):
        if q[token] > 0 and uniforms[index] < min(1.0, r[token] / q[token]):
            return token, index
        left = _residual(r, q)
        if left is None:  # unreachable in exact arithmetic: a rejection needs r(x) < q(x)
            break
        r = left
    return sample_from_distribution(r, float(uniforms[len(tokens)])), None


# -- measured on text -----------------------------------------------------------------------


def plain_answer(model: LoadedModel, prompt: list[int], config: SamplerConfig, n: int) -> list[int]:
    """prompt + the target's answer by plain decoding (no drafts; up to a stop token)."""
    from mtplx.engine import Engine
    from mtplx.request import GenerationRequest, TokenEvent

    request = GenerationRequest(prompt, config, max_tokens=n, depth=0)
    events = Engine(model).generate(request)
    return [*prompt, *(e.token_id for e in events if isinstance(e, TokenEvent))]


def position_one_distributions(
    model: LoadedModel, tokens: list[int], num_prompt: int, config: SamplerConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(p, q, scores), each [n, V]: for every answer position j >= num_prompt + 1, the
    target's distribution for x[j] and the head's first-draft distribution for x[j] (fed the
    pairs (h[m], x[m+1]) for m <= j - 2), both under ``config``, and the head's logits (what
    its candidates are ranked by); q is zero and the logits -inf outside the draft
    vocabulary."""
    trunk, head = model.target.trunk, model.mtp_heads[0]
    ids = mx.array(tokens, mx.int32)[None]
    hidden = trunk.inner(ids, None)  # [1, T, H]
    target_logits = trunk.lm_head(hidden)[0]  # [T, V]
    head_logits, _ = head(hidden[:, :-1], ids[:, 1:], head.make_cache())  # [1, T-1, V']
    mx.eval(target_logits, head_logits)
    positions = range(num_prompt + 1, len(tokens))
    p = distribution_from_logits(np.array(target_logits[positions.start - 1 : -1]), config)
    small = np.array(head_logits[0, positions.start - 2 : -1].astype(mx.float32))
    vocab_size = p.shape[-1]
    if model.draft_vocab is None:
        scores = small.astype(np.float64)
    else:
        scores = np.full((len(positions), vocab_size), -np.inf)
        scores[:, np.array(model.draft_vocab)] = small
    return p, distribution_from_logits(scores, config), scores


def estimate(
    model: LoadedModel,
    prompts: list[list[int]],
    config: SamplerConfig,
    max_tokens: int,
    candidates: list[int],
) -> dict[str, Any]:
    """Mean acceptance at position 1 over every answer position of ``prompts`` (answers by
    plain decoding under ``config``, seeded per prompt), per rule and candidate count."""
    sums: dict[str, float] = {}
    positions = 0
    for n, prompt in enumerate(prompts):
        seeded = SamplerConfig(temperature=config.temperature, top_p=config.top_p, seed=n)
        tokens = plain_answer(model, prompt, seeded, max_tokens)
        p, q, scores = position_one_distributions(model, tokens, len(prompt), config)
        for pj, qj, sj in zip(p, q, scores, strict=True):
            values = {"chain": chain_acceptance(pj, qj)}
            for k in candidates:
                values[f"top{k}"] = top_k_acceptance(pj, sj, k)
                values[f"iid{k}"] = recursive_rejection_acceptance(pj, qj, k)
            for key, value in values.items():
                sums[key] = sums.get(key, 0.0) + value
        positions += len(p)
    return {
        "temperature": config.temperature,
        "top_p": config.top_p,
        "prompts": len(prompts),
        "positions": positions,
        "acceptance": {key: value / max(positions, 1) for key, value in sums.items()},
    }


def verify_costs(
    model: LoadedModel, max_tokens: int, context: int = 200, repeats: int = 15
) -> dict[int, float]:
    """Median seconds of one row's target forward (all logits) over n = 1..max_tokens tokens
    after ``context`` committed ones, and (key 0) of one head step: what a verify of n - 1
    candidates costs, set against a plain step (n = 1)."""
    from mtplx.models.batched import batched_target

    batched = batched_target(model.target, 1)
    row = batched.new_row()
    out = batched.forward([row], [mx.arange(context, dtype=mx.int32) % 1000], "none")[0]
    mx.eval(out.hidden)
    costs = {}
    for n in [*range(1, max_tokens + 1)] * 2:  # the first pass warms up
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            out = batched.forward([row], [mx.full((n,), 5, mx.int32)], "all")[0]
            mx.eval(out.logits, out.hidden)
            times.append(time.perf_counter() - started)
            batched.trim(row, n)
        costs[n] = statistics.median(times)
    head = model.mtp_heads[0]
    cache = head.make_cache()
    hidden = mx.zeros((1, 1, model.target.hidden_size))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        logits, hidden = head(hidden, mx.array([[5]], mx.int32), cache)
        mx.eval(logits, hidden)
        times.append(time.perf_counter() - started)
    costs[0] = statistics.median(times)
    return costs


def main(argv: list[str] | None = None) -> int:
    from mtplx.train.compare import add_prompt_set_arguments, load_prompt_set

    parser = argparse.ArgumentParser(prog="python -m mtplx.train.multi_draft", description=__doc__)
    add_prompt_set_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.6])
    parser.add_argument("--top-p", type=float, default=0.95, help="with temperature > 0")
    parser.add_argument("--candidates", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--costs", action="store_true", help="also time verify forwards")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    model, prompts = load_prompt_set(args)
    report: dict[str, Any] = {"prompt_set": args.prompts, "estimates": []}
    for temperature in args.temperature:
        config = SamplerConfig(temperature=temperature, top_p=args.top_p if temperature else 1.0)
        result = estimate(model, prompts, config, args.max_tokens, args.candidates)
        report["estimates"].append(result)
        print(json.dumps(result), flush=True)
    if args.costs:
        costs = verify_costs(model, max(args.candidates) + 1)
        report["costs_seconds"] = costs
        print(json.dumps({"costs_ms": {n: round(s * 1e3, 2) for n, s in costs.items()}}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
