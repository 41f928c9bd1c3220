# The lead's plain decode loop (/tmp/prof/loop.py), with cycle_ab.py taken from $CYCLE_AB_DIR:
# a copy of benchmarks/results/2026-12-03-mtp-cycle-2/cycle_ab.py whose ROOT line reads
# ROOT = Path(os.environ["TREE"]) (with `import os`), so each tree loads its own kernel.
import os, sys, time
sys.path.insert(0, os.environ["CYCLE_AB_DIR"])
import cycle_ab as c
kind = sys.argv[1]
eng = c.Engine(c.load(c.ensure_default_model("native")))
eng.warm_up()
sw = c.Switch("a9c68d5")
sw.set("verify only" if kind == "verify" else "after")
drafter, depth = ("none", 0) if kind == "plain" else ("mtp", 1)
c._run(eng, drafter, depth, 64)
t = time.perf_counter(); n = 0
print("READY", os.getpid(), flush=True)
res = []
for _ in range(int(sys.argv[2])):
    res.append(c._run(eng, drafter, depth, 128))
print(kind, "median wall/proc/thread", [round(sorted(r[i] for r in res)[len(res)//2],2) for i in range(3)])
