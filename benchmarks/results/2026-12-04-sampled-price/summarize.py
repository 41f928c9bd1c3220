"""Per run of ``e2e.sh`` (bench-<code>-<n>/records.jsonl), per sampler: each mode's speed-up
over plain (per pair: same prompt, same repeat; median over pairs, and per category), and
the default mode's drafting cycles (all prompts) and drafted tokens. Also whether greedy
outputs equal plain's.

    python summarize.py
"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
runs = sorted(HERE.glob("bench-*-*/records.jsonl"), key=lambda p: (p.parent.name[-1], p.parent.name))
print("| run | sampler | default / plain (median of pairs) | mtp@1 / plain | default per category (chat, code, summarize, repeat) | default drafting cycles | default drafted tokens | greedy = plain |")
print("|---|---|---|---|---|---|---|---|")
for path in runs:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by = {(r["mode"], r["sampler"], r["prompt_id"], r["repeat"]): r for r in records}
    for sampler in ("greedy", "t0.6"):
        cells = []
        for mode in ("default", "mtp@1"):
            pairs = [
                (r["category"], r["decode_tps"] / by[("plain", sampler, r["prompt_id"], r["repeat"])]["decode_tps"])
                for r in records
                if r["mode"] == mode and r["sampler"] == sampler
            ]
            cells.append((statistics.median(x for _, x in pairs), pairs))
        per_category = []
        for category in ("chat", "code", "summarize", "repeat"):
            xs = [x for c, x in cells[0][1] if c == category]
            per_category.append(f"{statistics.median(xs):.2f}" if xs else "-")
        default = [r for r in records if r["mode"] == "default" and r["sampler"] == sampler]
        cycles = sum(r["num_cycles"] for r in default)
        drafted = sum(sum(r["drafted_per_position"]) for r in default)
        same = "-"
        if sampler == "greedy":
            ok = [
                r["token_ids"] == by[("plain", sampler, r["prompt_id"], r["repeat"])]["token_ids"]
                for r in records
                if r["sampler"] == sampler and r["mode"] != "plain"
            ]
            same = f"{sum(ok)}/{len(ok)}"
        print(
            f"| {path.parent.name} | {sampler} | {cells[0][0]:.2f}x | {cells[1][0]:.2f}x | "
            f"{', '.join(per_category)} | {cycles} | {drafted} | {same} |"
        )

print()
print("default mode's drafting cycles per category (1 prompt x 2 repeats x 64 tokens each)")
for path in runs:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = []
    for sampler in ("greedy", "t0.6"):
        cycles: dict[str, int] = {}
        for r in records:
            if r["mode"] == "default" and r["sampler"] == sampler:
                cycles[r["category"]] = cycles.get(r["category"], 0) + r["num_cycles"]
        out.append(f"{sampler}: {cycles}")
    print(path.parent.name, " | ".join(out))
