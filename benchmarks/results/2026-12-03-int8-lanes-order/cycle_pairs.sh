#!/bin/sh
# cycle_ab.py (../2026-12-03-mtp-cycle-3/) once per tree, alternating: this branch (after:
# the 8-bit unit blocks) and a clone of it with main's quant_kernel.c (before). Each
# process: plain, depth-1 MTP cycles and verify-only steps, paired within it.
for round in 1 2; do
  for side in after before; do
    if [ $side = after ]; then tree=/work/wt/kernel38; home=/work/wt/kernel38/.home; else tree=/tmp/k38/clone_before; home=/tmp/k38/home_before; fi
    echo "== $side round $round load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $tree && MTPLX_HOME=$home PYTHONPATH=$tree /work/main/.venv/bin/python \
        benchmarks/results/2026-12-03-mtp-cycle-3/cycle_ab.py --rounds 8 --before 5c0d4d1 2>&1 | grep -v converting)
  done
done
