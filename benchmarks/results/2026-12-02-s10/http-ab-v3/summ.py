import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for temp in sorted({r["temp"] for r in recs}):
    pairs, acc, dr, same = [], 0, 0, []
    by = {}
    for r in recs:
        if r["temp"] == temp: by.setdefault((r["rep"], r["prompt"]), {})[r["mode"]] = r
    per_prompt = {}
    for (rep, p), m in sorted(by.items()):
        if len(m) < 2 or not m["plain"]["decode_tps"] or not m["default"]["decode_tps"]: continue
        ratio = m["default"]["decode_tps"] / m["plain"]["decode_tps"]
        pairs.append(ratio); per_prompt.setdefault(p, []).append(ratio)
        mt = m["default"]["mtplx"]; a = mt["accepted_per_position"]; d = mt["drafted_per_position"]
        acc += a[0] if a else 0; dr += d[0] if d else 0
    tot = lambda mode: sum(by[k][mode]["tokens"] - 1 for k in by if len(by[k]) == 2) / sum((by[k][mode]["tokens"] - 1) / by[k][mode]["decode_tps"] for k in by if len(by[k]) == 2)
    print(f"T={temp}: {len(pairs)} pairs, median ratio {statistics.median(pairs):.3f}, mean {statistics.mean(pairs):.3f}, min {min(pairs):.2f} max {max(pairs):.2f}; "
          f"aggregate tok/s default {tot('default'):.2f} plain {tot('plain'):.2f} -> {tot('default')/tot('plain'):.3f}; pos-1 acceptance {acc}/{dr} = {acc/max(dr,1):.3f}")
    print("   per prompt medians:", {p: round(statistics.median(v), 2) for p, v in sorted(per_prompt.items())})
