#!/bin/sh
# products.sh DIR: prod_ab over the default model's product shapes at 1-384 rows, one process
# per shape and row count, the builds taking turns (order rotating):
#   before.so   the kernel as on main (every kind in 16-lane terms)
#   hybrid.so   this branch: 8-bit weights' whole 256-element blocks one lane a unit
#   uniform.so  the prototype: every kind (4-bit too) in unit blocks, the last partial
#               block by per-quarter sums
#   pretr.so    timing only: uniform.so without its register transpose (as if the weights
#               were stored transposed at load); its outputs are not the product
d=$1
for rows in 1 2 4 16 384; do
  case $rows in 1|2) reps=41; inner=20;; 4) reps=31; inner=10;; 16) reps=21; inner=4;; *) reps=7; inner=1;; esac
  echo "== rows $rows load $(cut -d' ' -f1-3 /proc/loadavg)"
  for nk in "960 576 4" "576 576 4" "3072 576 4" "576 1536 4" "49152 576 8"; do
    r=$reps; i=$inner
    if [ "$nk" = "49152 576 8" ]; then i=1; [ $rows -ge 16 ] && r=5; fi
    "$d/prod_ab" $nk $rows $r $i "$d/before.so" "$d/hybrid.so" "$d/uniform.so" "$d/pretr.so"
  done
done
