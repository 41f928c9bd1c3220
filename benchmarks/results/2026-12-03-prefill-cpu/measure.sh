#!/bin/bash
# Before (BEFORE: a checkout of the code before these changes, default /work/main at 464523a)
# against this tree, paired, alternating, in both activation modes; then a stream's gaps
# beside the prompt (both trees). usage: measure.sh OUTDIR [ROUNDS]
mkdir -p $1; OUT=$(realpath $1); ROUNDS=${2:-2}; BEFORE=${BEFORE:-/work/main}
ROOT=$(git rev-parse --show-toplevel); PY=${PY:-/work/main/.venv/bin/python}
BENCH=$ROOT/benchmarks/results/2026-12-03-prefill-cpu/prefill_cpu.py
mkdir -p $OUT; : > $OUT/prefill.txt; : > $OUT/gap.txt
for round in $(seq 1 $ROUNDS); do
  for mode in float32 int8; do
    for tree in $BEFORE $ROOT; do
      echo "== $tree $mode $(uptime)" >> $OUT/prefill.txt
      (cd $tree && MTPLX_ACTIVATIONS=$mode PYTHONPATH=$tree $PY $BENCH --repeats 2 2>&1 | grep tokens >> $OUT/prefill.txt)
    done
  done
done
for tree in $BEFORE $ROOT; do
  echo "== $tree float32 $(uptime)" >> $OUT/gap.txt
  (cd $tree && PYTHONPATH=$tree $PY $BENCH --repeats 2 --gap 2>&1 | grep gap_max >> $OUT/gap.txt)
done
