#!/bin/sh
# The int8 product alone at a layer's four shapes, 384 rows, one thread (qmm_harness.c):
# the kernel before (BEFORE, a commit) and as checked out, built with the extension's flags,
# turn about; min thread CPU ms of 15 calls per shape, and whether the outputs are the same
# bytes. usage: harness.sh BEFORE [ROWS]   (run from the repository root)
set -e
B=${1:?commit before}; M=${2:-384}; T=$(mktemp -d)
git show "$B":mtplx/quant_kernel.c > "$T/before.c"
F="-O3 -ffp-contract=off -fPIC -pthread -Wno-psabi -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx2 -mfma -mf16c"
D=$(dirname "$0")
gcc $F "$T/before.c" "$D/qmm_harness.c" -o "$T/before"
gcc $F mtplx/quant_kernel.c "$D/qmm_harness.c" -o "$T/after"
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
for round in 1 2 3; do
  for v in before after; do printf '%s ' $v; "$T/$v" "$M" 15 "$T/$v.bin" | tr '\n' ' '; echo; done
  cmp "$T/before.bin" "$T/after.bin" && echo "round $round: the same bytes"
done
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
rm -r "$T"
