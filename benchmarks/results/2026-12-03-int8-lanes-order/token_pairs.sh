#!/bin/sh
# token_ab.c (../2026-12-03-int8-arithmetic/) pairs: before.so (main's kernel) against
# hybrid.so (this branch), a decode token's 121 products from memory and the LM head alone,
# 1 and 2 threads, 1 and 2 rows, two rounds.
ab=$1; before=$2; after=$3
for round in 1 2; do
  for threads in 1 2; do
    for rows in 1 2; do
      echo "== round $round load $(cut -d' ' -f1-3 /proc/loadavg)"
      echo "from memory, all:   $("$ab" "$before" "$after" "$threads" "$rows" 30)"
      echo "LM head alone:      $("$ab" "$before" "$after" "$threads" "$rows" 30 2)"
    done
  done
done
