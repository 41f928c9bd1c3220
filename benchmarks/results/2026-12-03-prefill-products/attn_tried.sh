#!/bin/bash
# The attention kernel alone (../2026-12-03-prefill-cpu/attn_bench.c, one thread): the source at
# commit REV against the file NEW (the tried change: patch -o NEW mtplx/attn_kernel.c
# attn_transposed_tried.diff). usage: attn_tried.sh REV NEW  (from the repository root)
set -e
REV=${1:?commit before}; NEW=${2:?the attention source to compare}
ROOT=$(git rev-parse --show-toplevel)
HERE=$ROOT/benchmarks/results/2026-12-03-prefill-cpu
T=$(mktemp -d)
git -C $ROOT show $REV:mtplx/attn_kernel.c > $T/old.c
F="-O3 -ffp-contract=off -fPIC -pthread -Wno-psabi -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx2 -mfma -mf16c"
R="-Dmtplx_attend=old_attend -Dmtplx_attn_set_threads=old_set_threads -Dmtplx_attn_fused=old_fused -Dmtplx_attn_lanes=old_lanes -Dmtplx_attn_exp=old_exp -Dmtplx_attn_split_calls=old_split"
gcc $F $R -c $T/old.c -o $T/old.o
gcc $F -c "$NEW" -o $T/new.o
gcc $F $HERE/attn_bench.c $T/old.o $T/new.o -o $T/attn_bench -lm -pthread
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
for args in "384 1 8" "384 385 8" "384 769 8" "348 1153 8" "384 1025 8" "4 700 50" "1 1500 50"; do
  echo "n first repeats = $args: $($T/attn_bench $args)"
done
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
rm -rf $T
