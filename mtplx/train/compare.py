"""Where the MTP head's acceptance goes: the engine's drafts against an offline replay of the
head on the same text. ``python -m mtplx.train.compare --prompts benchmarks --depth 3``.

For each prompt the engine generates greedily (T=0) with drafter ``mtp`` at a fixed depth,
recording every cycle's draft tokens and every (hidden state, token) pair the drafter was fed.
The generated text is the same with and without drafting, so the replay then runs:

- one plain forward of the target over prompt + output: the post-norm hidden states h[i];
- the head, teacher-forced on the pairs (h[m], x[m+1]), drafting at each position j the
  tokens x[j], x[j+1], ... recursively, exactly as ``MTPDrafter.propose`` does (greedy over
  the draft vocabulary).

Reported per draft position d (1..depth):

- ``engine``: accepted / drafted from the engine's ``GenerationStats``;
- ``replay_schedule``: the same ratio when the replay's drafts run the engine's cycle schedule
  (start after the first token; advance by accepted + 1) -- what the offline evaluation
  predicts for the engine;
- ``replay_every_start``: the fraction of all start positions whose first d drafts all match
  (the usual offline "acceptance at position d");
- ``draft_mismatches``: engine cycles whose drafts differ from the replay's at the same
  position (should be ~0: only float noise between the two forwards' hidden states), and
  ``fed_pairs_ok`` / ``fed_hidden_max_diff``: whether the drafter was fed exactly the pairs
  (h[m], x[m+1]) for m = 0.., and how far its hidden states are from the plain forward's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mtplx.drafters.mtp import MTPDrafter
from mtplx.models.base import LoadedModel


class RecordingMTPDrafter(MTPDrafter):
    """``MTPDrafter`` that remembers what it was fed and what it drafted."""

    def __init__(self, model: LoadedModel) -> None:
        super().__init__(model)
        self.commits_lazily = False  # every commit reaches ``commit``, to be recorded
        self.fed_tokens: list[int] = []
        self.fed_hidden: list[mx.array] = []
        self.cycles: list[tuple[int, list[mx.array]]] = []  # (len(history), drafts)

    def reset(self, prompt_ids: list[int]) -> None:
        super().reset(prompt_ids)
        self.fed_tokens, self.fed_hidden, self.cycles = [], [], []

    def commit(self, new_tokens: list[int], target_hidden: mx.array | None) -> None:
        super().commit(new_tokens, target_hidden)
        self.fed_tokens.extend(new_tokens)
        self.fed_hidden.append(target_hidden)  # type: ignore[arg-type]

    def propose_batch(self, drafters, histories, ks, samplers):  # type: ignore[no-untyped-def]
        proposals = super().propose_batch(drafters, histories, ks, samplers)
        for drafter, history, (tokens, _) in zip(drafters, histories, proposals, strict=True):
            drafter.cycles.append((len(history), tokens))
        return proposals


def recording_engine(model: LoadedModel, **kwargs: Any) -> Any:
    """An ``Engine`` (``kwargs`` passed on) whose drafter ``mtp`` records."""
    from mtplx.engine import Engine

    engine = Engine(model, **kwargs)
    engine._drafters["mtp"] = lambda: RecordingMTPDrafter(model)
    return engine


def engine_run(
    model: LoadedModel, prompt: list[int], depth: int | None, max_tokens: int, engine: Any = None
) -> tuple[list[int], Any, RecordingMTPDrafter]:
    """Greedy generation with drafter ``mtp`` at ``depth`` (None: adaptive) on ``engine``
    (default: a fresh ``recording_engine``): (prompt + output tokens, stats, the drafter)."""
    from mtplx.request import FinishEvent, GenerationRequest, SamplerConfig

    if engine is None:
        engine = recording_engine(model)
    request = GenerationRequest(
        prompt, SamplerConfig(temperature=0), max_tokens=max_tokens, drafter="mtp", depth=depth
    )
    sequence = engine.add(request)
    stats = None
    try:
        while not sequence.finished:
            for _, event in engine.step():
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, FinishEvent):
                    stats = event.stats
    finally:
        engine.abort(sequence)
    drafter = sequence.drafter
    assert isinstance(drafter, RecordingMTPDrafter)
    return list(sequence.tokens), stats, drafter


def target_hidden(model: LoadedModel, tokens: list[int]) -> mx.array:
    """[T, H] post-norm hidden states of one plain forward over ``tokens``."""
    hidden = model.target.trunk.inner(mx.array(tokens, mx.int32)[None], None)[0]
    mx.eval(hidden)
    return hidden


def replay_drafts(
    model: LoadedModel,
    tokens: list[int],
    hidden: mx.array,
    starts: list[int],
    depth: int,
    first_pair: int = 0,
) -> dict[int, list[int]]:
    """Greedy head drafts at each position j of ``starts`` (ascending, > first_pair + 1):
    ``depth`` tokens for x[j], x[j+1], ..., from the pairs (hidden[m], tokens[m+1]) for
    first_pair <= m <= j - 2 (the head's cache starts at pair ``first_pair``)."""
    from mtplx import cache as cache_ops

    head = model.mtp_heads[0]
    vocab = None if model.draft_vocab is None else np.array(model.draft_vocab)
    cache = head.make_cache()
    fed = first_pair  # pairs fed so far (the cache holds first_pair..fed-1)
    drafts: dict[int, list[int]] = {}

    def to_token(logits: mx.array) -> int:
        index = int(mx.argmax(logits).item())
        return int(vocab[index]) if vocab is not None else index

    for j in starts:
        upto = j - 1  # pairs 0..j-2
        if upto > fed:
            h = hidden[None, fed:upto]
            x = mx.array(tokens[fed + 1 : upto + 1], mx.int32)[None]
            logits, out = head(h, x, cache)
            fed = upto
        point = cache_ops.checkpoint(cache)
        got = [to_token(logits[0, -1])]
        last = out[:, -1:]
        for _ in range(depth - 1):
            step_logits, last = head(last, mx.array([[got[-1]]], mx.int32), cache)
            got.append(to_token(step_logits[0, -1]))
        cache_ops.rollback(cache, point)
        drafts[j] = got
    return drafts


def score(
    drafts: dict[int, list[int]], tokens: list[int], num_prompt: int, depth: int, max_tokens: int
) -> dict[str, Any]:
    """The replay's drafts scored against the text: over the engine's cycle schedule at a
    fixed ``depth`` (``replay_*``) and over every start position (``every_*``)."""
    end = len(tokens)
    sched_acc, sched_drafted = [0] * depth, [0] * depth
    j = num_prompt + 1
    while j < end:
        k = min(depth, max_tokens - (j - num_prompt) - 1)  # the planner's limit
        if k <= 0:
            break
        truth = tokens[j : j + k]
        n = 0
        while n < len(truth) and drafts[j][n] == truth[n]:
            n += 1
        for d in range(k):
            sched_drafted[d] += 1
            sched_acc[d] += d < n
        j += n + 1
    every_acc, every_n = [0] * depth, 0
    for j in range(num_prompt + 1, end - depth + 1):
        every_n += 1
        for d in range(depth):
            if drafts[j][: d + 1] != tokens[j : j + d + 1]:
                break
            every_acc[d] += 1
    return {
        "replay_accepted": sched_acc,
        "replay_drafted": sched_drafted,
        "every_accepted": every_acc,
        "every_starts": every_n,
    }


def compare_prompt(
    model: LoadedModel,
    prompt: list[int],
    depth: int,
    max_tokens: int,
    prompt_context: int | None = None,
    engine: Any = None,
    engine_depth: int | str | None = "same",
) -> dict[str, Any]:
    """Engine vs replay counts for one prompt (see the module docstring). ``prompt_context``:
    also score a replay whose head sees only the last that many prompt pairs, as in training
    (``mtplx.train.data``: 16), under ``context_*``. ``engine``: a ``recording_engine`` to
    run on (a prefix cache, say); ``engine_depth``: the engine's depth when not ``depth``
    (None: adaptive; the replay still drafts ``depth`` tokens at every position)."""
    run_depth = depth if engine_depth == "same" else engine_depth
    tokens, stats, drafter = engine_run(model, prompt, run_depth, max_tokens, engine)  # type: ignore[arg-type]
    hidden = target_hidden(model, tokens)
    num_prompt = len(prompt)
    starts = list(range(num_prompt + 1, len(tokens)))
    drafts = replay_drafts(model, tokens, hidden, starts, depth)

    # The pairs the engine fed: (hidden[m], tokens[m+1]) for m = 0, 1, ...
    # (The last cycle may commit past a stop: those pairs are beyond the emitted text.)
    num_pairs = min(len(drafter.fed_tokens), len(tokens) - 1)
    pairs_ok = drafter.fed_tokens[:num_pairs] == tokens[1 : 1 + num_pairs]
    fed_hidden = mx.concatenate(drafter.fed_hidden, axis=1)[0, :num_pairs]
    diff = float(mx.max(mx.abs(fed_hidden - hidden[: fed_hidden.shape[0]])).item())

    # The engine's cycles against the replay's drafts at the same position.
    mismatches = 0
    for position, cycle in drafter.cycles:
        got = [int(t.item()) for t in cycle]
        if position in drafts and got != drafts[position][: len(got)]:
            mismatches += 1
    vocab = set() if model.draft_vocab is None else set(np.array(model.draft_vocab).tolist())
    result = {
        "output_tokens": len(tokens) - num_prompt,
        "prompt_tokens": num_prompt,
        # output tokens the head cannot draft (outside its draft vocabulary)
        "outside_draft_vocab": sum(t not in vocab for t in tokens[num_prompt:]) if vocab else 0,
        "tokens": tokens,
        "engine_accepted": list(stats.accepted_per_position[:depth]),
        "engine_drafted": list(stats.drafted_per_position[:depth]),
        **score(drafts, tokens, num_prompt, depth, max_tokens),
        "engine_cycles": len(drafter.cycles),
        "draft_mismatches": mismatches,
        "fed_pairs_ok": pairs_ok,
        "fed_hidden_max_diff": diff,
    }
    if prompt_context is not None:
        first = max(num_prompt - prompt_context, 0)
        short = replay_drafts(model, tokens, hidden, starts, depth, first)
        scored = score(short, tokens, num_prompt, depth, max_tokens)
        result.update({f"context_{k}": v for k, v in scored.items()})
    return result


def _ratio(a: list[int], b: list[int]) -> list[float]:
    return [x / y if y else 0.0 for x, y in zip(a, b, strict=False)]


def summarize(results: list[dict[str, Any]], depth: int) -> dict[str, Any]:
    """Sums over prompts, as ratios per draft position."""

    def total(key: str) -> list[int]:
        out = [0] * depth
        for r in results:
            for d, v in enumerate(r[key]):
                out[d] += v
        return out

    every_n = sum(r["every_starts"] for r in results)
    engine_acc, engine_dr = total("engine_accepted"), total("engine_drafted")
    cycles = sum(r["engine_cycles"] for r in results)
    out: dict[str, Any] = {
        "depth": depth,
        "prompts": len(results),
        "output_tokens": sum(r["output_tokens"] for r in results),
        "outside_draft_vocab": sum(r["outside_draft_vocab"] for r in results),
        "engine": _ratio(engine_acc, engine_dr),
        "engine_mean_acceptance_length": 1 + sum(engine_acc) / engine_dr[0] if engine_dr else 1,
        "replay_schedule": _ratio(total("replay_accepted"), total("replay_drafted")),
        "replay_every_start": [a / every_n if every_n else 0.0 for a in total("every_accepted")],
        "engine_cycles": cycles,
        "draft_mismatches": sum(r["draft_mismatches"] for r in results),
        "fed_pairs_ok": all(r["fed_pairs_ok"] for r in results),
        "fed_hidden_max_diff": max(r["fed_hidden_max_diff"] for r in results),
    }
    if all("context_every_starts" in r for r in results):
        every_c = sum(r["context_every_starts"] for r in results)
        out["context_replay_schedule"] = _ratio(
            total("context_replay_accepted"), total("context_replay_drafted")
        )
        out["context_replay_every_start"] = [
            a / every_c if every_c else 0.0 for a in total("context_every_accepted")
        ]
    return out


PROMPT_SETS = ("benchmarks", "heldout", "train", "broad")


def prompt_messages(
    kind: str, count: int, seed: int = 0
) -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    """(user text, earlier turns) of the first ``count`` prompts of a set: ``broad`` is the
    held-out split of ``mtplx.train.prompts_broad`` (fillers and templates never trained on,
    some multi-turn); the others as ``prompt_texts``."""
    if kind == "broad":
        from mtplx.train.prompts_broad import build_broad_prompts

        _, heldout = build_broad_prompts(seed)
        return [(p.text, p.history) for p in heldout[:count]]
    return [(t, ()) for t in prompt_texts(kind, count, seed)]


def prompt_texts(kind: str, count: int, seed: int = 0) -> list[str]:
    """``heldout`` / ``train``: mtplx.train.prompts (topics the head never saw / saw);
    ``benchmarks``: benchmarks/prompts/*.jsonl round-robin over the files."""
    if kind in ("heldout", "train"):
        from mtplx.train.prompts import build_prompts

        train, heldout = build_prompts(seed)
        return [p.text for p in (heldout if kind == "heldout" else train)[:count]]
    root = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"
    files = [
        [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
        for path in sorted(root.glob("*.jsonl"))
    ]
    texts: list[str] = []
    for row in range(max(len(f) for f in files)):
        texts.extend(f[row] for f in files if row < len(f))
    return texts[:count]


def add_prompt_set_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--head``, ``--prompts``, ``--count``: a target, its head and prompts."""
    parser.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M")
    parser.add_argument("--head", type=Path, default=None, help="mtp safetensors")
    parser.add_argument("--prompts", choices=PROMPT_SETS, default="benchmarks")
    parser.add_argument("--count", type=int, default=12)


def load_prompt_set(args: argparse.Namespace) -> tuple[LoadedModel, list[list[int]]]:
    """The model of ``add_prompt_set_arguments``' options (with ``--head``) and the chat
    prompt ids of the first ``--count`` prompts of ``--prompts``."""
    from mtplx.models import load
    from mtplx.models.gguf import ensure_default_model
    from mtplx.train.data import chat_prompt_ids

    model = load(args.model or ensure_default_model(), mtp_weights=args.head)
    messages = prompt_messages(args.prompts, args.count)
    return model, [chat_prompt_ids(model.tokenizer, text, turns) for text, turns in messages]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtplx.train.compare", description=__doc__)
    add_prompt_set_arguments(parser)
    parser.add_argument("--depth", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument(
        "--prompt-context",
        type=int,
        default=None,
        help="also replay with the head seeing only the last N prompt pairs (training: 16)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    model, prompts = load_prompt_set(args)
    report = []
    for depth in args.depth:
        results = [
            compare_prompt(model, p, depth, args.max_tokens, args.prompt_context) for p in prompts
        ]
        summary = summarize(results, depth)
        summary["prompt_set"] = args.prompts
        report.append({"summary": summary, "per_prompt": results})
        print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
