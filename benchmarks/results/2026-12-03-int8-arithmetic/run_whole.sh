#!/bin/sh
# The whole model, main (before) and this branch (after), one after the other, alternating:
# scripts/quant_bench.py --repeats 3, then mtplx bench --quick --modes plain,llamacpp.
# Usage (from this directory): sh run_whole.sh MAIN_TREE BRANCH_TREE
main=$1; branch=$2; here=$(pwd)
for side in after before; do
  tree=$main; [ "$side" = after ] && tree=$branch
  echo "== quant_bench $side load $(cut -d' ' -f1-3 /proc/loadavg)" > "$here/quant_bench_$side.txt"
  (cd "$tree" && PYTHONPATH=$tree /work/main/.venv/bin/python scripts/quant_bench.py --repeats 3 >> "$here/quant_bench_$side.txt" 2>&1)
done
for round in 1 2; do
  for side in before after; do
    tree=$main; [ "$side" = after ] && tree=$branch
    echo "== bench $side round $round load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$here/bench_loads.txt"
    (cd "$tree" && PYTHONPATH=$tree /work/main/.venv/bin/mtplx bench --quick --modes plain,llamacpp --no-progress --out "$here/bench-$side$round" > /dev/null 2>&1)
    echo "   end load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$here/bench_loads.txt"
  done
done
