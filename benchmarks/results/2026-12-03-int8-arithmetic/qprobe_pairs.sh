#!/bin/sh
# qprobe (the brief's probe: one quant.qmm per mx.eval) with main's kernel (before) and this
# branch's (after), alternating, for 1 and 2 threads; the load average before each run.
# Usage: sh qprobe_pairs.sh MAIN_TREE BRANCH_TREE ROUNDS > qprobe.txt
main=$1; branch=$2; rounds=${3:-2}
for r in $(seq "$rounds"); do
  for threads in 1 2; do
    for side in before after; do
      tree=$main; [ "$side" = after ] && tree=$branch
      echo "== round $r threads $threads $side ($(cut -d' ' -f1-3 /proc/loadavg))"
      (cd "$tree" && PYTHONPATH=$tree /work/main/.venv/bin/python /work/wt/briefs/qprobe.py "$threads")
    done
  done
done
