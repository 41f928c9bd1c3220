"""Summarize decompose.py's steps.jsonl: per mode the paired decode-rate ratio over plain,
and per step kind (how the schedule ran the one row) its count, mean wall / CPU, tokens.

    python summarize.py DIR/steps.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def kind(step: dict) -> str:
    """What the step did for the one row."""
    plans = step.get("plans") or []
    groups = step.get("groups")
    if not plans:
        return "prompt"
    source, depth = plans[0]
    if groups is None or "forward" not in step:
        if step.get("close_ahead"):
            return "close plain (no forward)"
        if step.get("close_queued"):
            return "close draft (no forward)"
        return "no forward"
    plain, drafting, ahead = groups
    if plain:
        return "plain" + (" (first after a draft)" if step["tokens"] == 0 else "")
    if drafting:
        return f"sync {source}@{depth}"
    return f"ahead {source}@{depth}"


def main() -> None:
    runs = [json.loads(line) for line in open(sys.argv[1])]
    by_prompt: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for run in runs:
        by_prompt[(run["prompt_id"], run["repeat"])][run["mode"]] = run
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    print(
        f"runs: {len(runs)}; load: {min(r['load'] for r in runs):.1f}-{max(r['load'] for r in runs):.1f}"
    )
    print()
    print(
        "| mode | decode tok/s (median) | paired ratio median (min-max) | aggregate | CPU ratio (median) | same tokens |"
    )
    print("|---|---|---|---|---|---|")
    for mode in modes:
        pairs = [(p[mode], p["plain"]) for p in by_prompt.values() if mode in p and "plain" in p]
        ratios = [a["decode_tps"] / b["decode_tps"] for a, b in pairs]
        agg = sum(b["decode_time"] for a, b in pairs) / sum(a["decode_time"] for a, b in pairs)
        cpu = [a["proc"] / b["proc"] for a, b in pairs]
        same = sum(a["token_ids"] == b["token_ids"] for a, b in pairs)
        tps = statistics.median(a["decode_tps"] for a, _ in pairs)
        print(
            f"| {mode} | {tps:.1f} | {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}) "
            f"| {agg:.3f} | {1 / statistics.median(cpu):.3f} | {same}/{len(pairs)} |"
        )
    print()
    plain_step = None
    for mode in modes:
        kinds: dict[str, list[dict]] = defaultdict(list)
        for run in (r for r in runs if r["mode"] == mode):
            for step in run["steps"][1:]:  # the prompt's step left out
                kinds[kind(step)].append(step)
        total_steps = sum(len(v) for v in kinds.values())
        total_wall = sum(s["wall"] for v in kinds.values() for s in v)
        total_tokens = sum(s["tokens"] for v in kinds.values() for s in v)
        print(
            f"## {mode}: {total_steps} steps, {total_tokens} tokens, {1e3 * total_wall / total_tokens:.2f} ms/token (steps after the prompt's)"
        )
        print(
            "| step kind | steps | share of wall | mean wall ms | median wall ms | mean thread CPU ms | mean proc CPU ms | tokens/step | accepted drafts/step |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for name, steps in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
            walls = [s["wall"] for s in steps]
            if name == "plain" and mode == "plain":
                plain_step = statistics.mean(walls)
            print(
                f"| {name} | {len(steps)} | {sum(walls) / total_wall:.1%} | {1e3 * statistics.mean(walls):.2f} "
                f"| {1e3 * statistics.median(walls):.2f} | {1e3 * statistics.mean(s['thread'] for s in steps):.2f} "
                f"| {1e3 * statistics.mean(s['proc'] for s in steps):.2f} "
                f"| {statistics.mean(s['tokens'] for s in steps):.2f} | {statistics.mean(s['drafted'] for s in steps):.2f} |"
            )
        print()
    if plain_step:
        print(f"plain step mean wall: {1e3 * plain_step:.2f} ms")
    print()
    print("Robust to the host's slow spells: each step kind priced at its median wall, per mode")
    print(
        "(steps after the prompt's, all runs of the mode); ratio: plain's ms/token over the mode's."
    )
    print()
    print("| mode | ms/token, medians | ratio | ms/token, CPU medians | ratio |")
    print("|---|---|---|---|---|")
    priced = {}
    for mode in modes:
        kinds = defaultdict(list)
        for run in (r for r in runs if r["mode"] == mode):
            for step in run["steps"][1:]:
                kinds[kind(step)].append(step)
        tokens = sum(s["tokens"] for v in kinds.values() for s in v)
        wall = sum(len(v) * statistics.median(s["wall"] for s in v) for v in kinds.values())
        cpu = sum(len(v) * statistics.median(s["proc"] for s in v) for v in kinds.values())
        priced[mode] = (1e3 * wall / tokens, 1e3 * cpu / tokens)
    base = priced.get("plain")
    for mode, (w, c) in priced.items():
        rw = base[0] / w if base else float("nan")
        rc = base[1] / c if base else float("nan")
        print(f"| {mode} | {w:.2f} | {rw:.3f} | {c:.2f} | {rc:.3f} |")


if __name__ == "__main__":
    main()
