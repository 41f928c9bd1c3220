"""Held-out acceptance of an MTP head through the real engine:
``python -m mtplx.train.evaluate --head FILE``.

Runs the held-out prompts of ``mtplx.train.prompts.build_prompts`` (topics never used in
training) with drafter ``mtp`` at a fixed depth, greedy and sampled, and reports position-k
acceptance (accepted / drafted at draft position k, summed over prompts) and the mean
acceptance length (committed tokens per verify forward, over drafting cycles).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from mtplx.models.base import LoadedModel


def run_prompts(
    model: LoadedModel,
    prompt_ids: list[list[int]],
    *,
    temperature: float,
    top_p: float = 1.0,
    depth: int = 3,
    max_tokens: int = 96,
    seed: int = 0,
) -> dict[str, Any]:
    """Aggregate speculative statistics over ``prompt_ids`` for one sampler setting."""
    from mtplx.engine import Engine
    from mtplx.request import FinishEvent, GenerationRequest, SamplerConfig

    engine = Engine(model)
    accepted = [0] * depth
    drafted = [0] * depth
    num_accepted = num_drafts = tokens = 0
    started = time.monotonic()
    for n, ids in enumerate(prompt_ids):
        sampler = SamplerConfig(temperature=temperature, top_p=top_p, seed=seed + n)
        request = GenerationRequest(ids, sampler, max_tokens=max_tokens, drafter="mtp", depth=depth)
        for event in engine.generate(request):
            if isinstance(event, FinishEvent):
                stats = event.stats
                got = list(stats.accepted_per_position)
                for k, d in enumerate(stats.drafted_per_position[:depth]):
                    drafted[k] += d
                    accepted[k] += got[k] if k < len(got) else 0
                num_accepted += stats.num_accepted_tokens
                num_drafts += stats.num_drafts
                tokens += stats.completion_tokens
    seconds = time.monotonic() - started
    return {
        "temperature": temperature,
        "top_p": top_p,
        "depth": depth,
        "prompts": len(prompt_ids),
        "completion_tokens": tokens,
        "acceptance_per_position": [
            a / d if d else 0.0 for a, d in zip(accepted, drafted, strict=True)
        ],
        "drafted_per_position": drafted,
        "accepted_per_position": accepted,
        "mean_acceptance_length": (num_accepted + num_drafts) / num_drafts if num_drafts else 1.0,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
    }


def evaluate_head(
    model_dir: Path,
    head: Path | None,
    *,
    num_prompts: int = 16,
    max_tokens: int = 96,
    depth: int = 3,
    seed: int = 0,
    settings: tuple[tuple[float, float], ...] = ((0.0, 1.0), (0.6, 0.95)),
    prompt_set: str = "heldout",
) -> list[dict[str, Any]]:
    """Results on ``prompt_set`` (``mtplx.train.compare.PROMPT_SETS``; default the template
    generator's held-out prompts) for each (temperature, top_p) in ``settings``."""
    from mtplx.models import load
    from mtplx.train.compare import prompt_messages
    from mtplx.train.data import chat_prompt_ids

    model = load(model_dir, mtp_weights=head)
    messages = prompt_messages(prompt_set, num_prompts, seed)
    ids = [chat_prompt_ids(model.tokenizer, text, history) for text, history in messages]
    results = [
        run_prompts(model, ids, temperature=t, top_p=p, depth=depth, max_tokens=max_tokens)
        for t, p in settings
    ]
    for r in results:
        r["prompt_set"] = prompt_set
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtplx.train.evaluate", description=__doc__)
    parser.add_argument(
        "--head",
        type=Path,
        default=None,
        help="mtp safetensors (default: the checkpoint's own mtp.safetensors)",
    )
    parser.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M")
    parser.add_argument("--prompts", type=int, default=16, help="how many prompts")
    parser.add_argument(
        "--prompt-set",
        default="heldout",
        help="heldout (template generator), broad (mtplx.train.prompts_broad held-out), "
        "benchmarks (benchmarks/prompts/*.jsonl) or train",
    )
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="the prompt split's seed")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    from mtplx.models.gguf import ensure_default_model

    model_dir = args.model or ensure_default_model()
    results = evaluate_head(
        model_dir,
        args.head,
        num_prompts=args.prompts,
        max_tokens=args.max_tokens,
        depth=args.depth,
        seed=args.seed,
        prompt_set=args.prompt_set,
    )
    for r in results:
        pos = ", ".join(f"{a:.1%}" for a in r["acceptance_per_position"])
        print(
            f"{r['prompt_set']} T={r['temperature']} top_p={r['top_p']} depth={r['depth']}: "
            f"acceptance by position [{pos}], "
            f"mean acceptance length {r['mean_acceptance_length']:.2f} "
            f"({r['completion_tokens']} tokens, {r['tokens_per_second']:.1f} tok/s)"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
