#!/bin/sh
# mtplx bench --quick, modes plain,default,mtp@1 (greedy and t0.6: T=0.6, top-p 0.95,
# top-k 20), before (861d0bb: greedy-only calibration, in BEFORE_TREE, a copy of that
# commit's files) and after (this worktree), one process each, turn about: before, after,
# before, after. Both use MTPLX_HOME (the calibration version, 4 and 5, is in the cache key,
# so each finds its own calibration). Run from the worktree root.
set -x
OUT=$(pwd)/benchmarks/results/2026-12-04-sampled-price
BEFORE_TREE=${BEFORE_TREE:-/tmp/sprice42-head}
PY=/work/main/.venv/bin/python
for n in ${ROUNDS:-1 2}; do
  uptime
  (cd "$BEFORE_TREE" && PYTHONPATH="$BEFORE_TREE" nice -n 5 $PY -m mtplx bench --quick --modes plain,default,mtp@1 --no-progress --out "$OUT/bench-before-$n") > "$OUT/bench-before-$n.log" 2>&1
  uptime
  PYTHONPATH=$(pwd) nice -n 5 $PY -m mtplx bench --quick --modes plain,default,mtp@1 --no-progress --out "$OUT/bench-after-$n" > "$OUT/bench-after-$n.log" 2>&1
done
uptime
