#!/bin/sh
# Paired A/B of the int8 kernel's tiles, in one process: copies of mtplx_qmm_int8 built from
# the kernel before the change with the tile choices as macros (R2C..R6C: the columns of an
# R-row tile; SPECR/SPECLO: which row counts take the 16-groups scale path), each linked
# under its own name (rows_ab.c calls them turn about, the order rotating, and checks they
# give the same bits). Usage: rows_ab.sh BEFORE_COMMIT; then ./b ROWS VARIANTS [FIRST_SHAPE].
set -e
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/rows_ab}
mkdir -p "$out" && cd "$out"
git -C "$here" show "${1:-fdfc476}:mtplx/quant_kernel.c" > k.c
python3 - <<'PY'
s = open("k.c").read()
s = s.replace("case 2: I8_ROW_TILE(2, I8_COLS); break;", "case 2: I8_ROW_TILE(2, R2C); break;")
for r in (3, 4, 5, 6):
    s = s.replace(f"case {r}: I8_ROW_TILE({r}, I8_COLS); break;", f"case {r}: I8_ROW_TILE({r}, R{r}C); break;")
s = s.replace("R <= 2 && first == 0", "R <= SPECR && R >= SPECLO && first == 0")
pre = "".join(f"#ifndef {m}\n#define {m} {v}\n#endif\n" for m, v in
              [("R2C", 3), ("R3C", 3), ("R4C", 3), ("R5C", 3), ("R6C", 3), ("SPECR", 2), ("SPECLO", 1)])
open("k.c", "w").write(pre + s)
PY
F="-O3 -ffp-contract=off -pthread -Wno-psabi -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx2 -mfma -mf16c"
mk() { name=$1; shift; gcc $F "$@" -c k.c -o $name.tmp.o
       objcopy --redefine-sym mtplx_qmm_int8=$name $name.tmp.o
       objcopy --keep-global-symbol=$name $name.tmp.o $name.o; }
# The runs in the README: v0 before; v1 2 rows in 4 columns, per-term scales; v2 and v3 also
# 3-6 rows in 4 columns. The landed kernel: v3 for 4-bit weights but with 3 rows in 3; 8-bit weights in 3.
mk v0
mk v1 -DR2C=4 -DSPECR=1
mk v2 -DR2C=4 -DSPECR=1 -DR3C=4 -DR4C=4
mk v3 -DR2C=4 -DSPECR=1 -DR3C=4 -DR4C=4 -DR5C=4 -DR6C=4
gcc -O2 "$here/rows_ab.c" v0.o v1.o v2.o v3.o -o b -lpthread
