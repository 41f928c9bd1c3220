"""From decompose.py's steps.jsonl: per mode, the planner's choices (source@depth per step,
the requests' share of each), and the first-draft acceptance early in a request (first 16
decode steps) against later, from what the steps committed.

    python planner_choices.py DIR/steps.jsonl
"""

import json
import sys
from collections import Counter


def main() -> None:
    with open(sys.argv[1]) as f:
        runs = [json.loads(line) for line in f]
    for mode in dict.fromkeys(r["mode"] for r in runs):
        plans: Counter = Counter()
        early = [0, 0]  # [accepted-draft tokens, drafting steps] in the first 16 steps
        late = [0, 0]
        for run in (r for r in runs if r["mode"] == mode):
            for i, step in enumerate(run["steps"][1:]):
                for source, depth in step.get("plans") or []:
                    plans[f"{source}@{depth}" if depth else "plain"] += 1
                closed = step.get("close_queued") or step.get("groups", [0, 0, 0])[1]
                if closed and step["tokens"]:
                    bucket = early if i < 16 else late
                    bucket[0] += step["drafted"]
                    bucket[1] += 1
        total = sum(plans.values())
        shares = ", ".join(f"{k} {v / total:.1%}" for k, v in plans.most_common())
        print(f"## {mode}: plans over {total} steps: {shares}")
        for name, (acc, n) in (("first 16 steps", early), ("after", late)):
            if n:
                print(f"  accepted draft tokens per verified cycle, {name}: {acc / n:.2f} ({n})")


if __name__ == "__main__":
    main()
