#!/bin/sh
# token_ab.c's pairs: main's quant_kernel.c (before.so) against this branch's (after.so), both
# built with the avx512vnni variant's flags:
#   gcc -O3 -ffp-contract=off -fPIC -pthread -Wno-psabi -mavx512f -mavx512bw -mavx512vl \
#       -mavx512vnni -mavx2 -mfma -mf16c -shared quant_kernel.c -o X.so
# Usage: sh token_pairs.sh TOKEN_AB BEFORE.so AFTER.so > token_ab.txt
ab=$1; before=$2; after=$3
for round in 1 2; do
  for threads in 1 2; do
    for rows in 1 2; do
      echo "== round $round load $(cut -d' ' -f1-3 /proc/loadavg)"
      echo "from memory, all:   $("$ab" "$before" "$after" "$threads" "$rows" 30)"
      echo "from memory, layers: $("$ab" "$before" "$after" "$threads" "$rows" 30 1)"
      echo "LM head alone:      $("$ab" "$before" "$after" "$threads" "$rows" 30 2)"
      echo "layers, one layer's weights (hot): $(HOT=1 "$ab" "$before" "$after" "$threads" "$rows" 30 1)"
    done
  done
done
