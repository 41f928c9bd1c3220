"""Per side (before, after): the HTTP comparison's pairs over all its runs (median and range
of the per-pair default / plain ratio, same text, the share of cycles that drafted), and the
in-process chat bench's summary lines.

    python summarize_e2e.py OUTDIR
"""
import glob
import json
import statistics
import sys

out = sys.argv[1]
for side in ("before", "after"):
    ratios, same, cycles, drafts, acc = [], 0, 0, 0, []
    for path in sorted(glob.glob(f"{out}/serve-compare-{side}-*/compare.json")):
        doc = json.load(open(path))
        for pair in doc["pairs"]:
            spec, plain = pair["speculative"], pair["plain"]
            # bench-serve's own ratio: decode tok/s (tokens after the first over the seconds
            # after the first content), speculative over plain
            rate = [(r["tokens"] - 1) / (r["last_content"] - r["ttft"]) for r in (spec, plain)]
            ratios.append(rate[0] / rate[1])
            same += spec["text"] == plain["text"]
            cycles += spec["mtplx"]["cycles"]
            drafts += spec["mtplx"]["drafts"]
        for summary in doc["summaries"]:
            acc.append(summary["ratio_median"])
    print(
        f"{side}: {len(ratios)} pairs; decode-rate ratio per pair median {statistics.median(ratios):.3f} "
        f"({min(ratios):.2f}-{max(ratios):.2f}); runs' own per-pair medians {[round(a, 3) for a in acc]}; "
        f"same text {same}/{len(ratios)}; cycles that drafted {drafts}/{cycles}"
    )
