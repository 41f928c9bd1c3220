import random, statistics
from mtplx.depth_policy import AdaptiveDepth
head = 3.4 / 42.7; per = 4.3 / 42.7
COSTS = [1.0] + [1.0 + per * (k + 1) - per + head * k + per for k in range(1, 6)]  # ~1.18 at depth 1
COSTS = [1.0] + [1.0 + (per + head) * k for k in range(1, 6)]
def run(a, z, seed, tokens=96):
    rng = random.Random(seed)
    p = AdaptiveDepth(COSTS, prior_acceptance=0.3, optimism=z)
    made, cost = 0, 0.0
    while made < tokens:
        k = p.choose()
        acc = 0
        for _ in range(k):
            if rng.random() < a: acc += 1
            else: break
        made += acc + 1; cost += COSTS[k]
        if k: p.update(k, acc)
    return made / cost
print("costs", ["%.3f" % c for c in COSTS])
for a in (0.0, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.45):
    row = []
    for z in (0.0, 0.5, 1.0):
        row.append(statistics.mean(run(a, z, s) for s in range(300)))
    best_fixed = max((1 + sum(a ** j for j in range(1, k + 1))) / COSTS[k] for k in range(6))
    print("a=%.2f" % a, " ".join("z=%.1f %.3f" % (z, r) for z, r in zip((0, 0.5, 1), row)), "oracle %.3f" % best_fixed)
