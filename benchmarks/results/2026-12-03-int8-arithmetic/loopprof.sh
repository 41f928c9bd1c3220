#!/bin/sh
# perf of the plain decode loop (loop.py here, 6 x 128 tokens) from its READY line on.
# Usage: CYCLE_AB_DIR=DIR sh loopprof.sh TREE TAG   (DIR: see loop.py)
loop=$(cd "$(dirname "$0")" && pwd)/loop.py
cd "$1"
(TREE=$1 PYTHONPATH=$1 /work/main/.venv/bin/python "$loop" plain 6 > /tmp/loop_$2.out 2>&1 &)
for i in $(seq 240); do grep -q READY /tmp/loop_$2.out && break; sleep 0.5; done
pid=$(grep READY /tmp/loop_$2.out | awk '{print $2}')
perf record -F 1999 -p "$pid" -o /tmp/lp_$2.data > /dev/null 2>&1
echo "$2 load $(cut -d' ' -f1-3 /proc/loadavg) $(tail -1 /tmp/loop_$2.out)"
perf report -i /tmp/lp_$2.data --no-children --sort dso,sym -F overhead,sample,dso,sym 2>/dev/null |
  grep -E "columns_int8|helper_main|quantize_rows" | sed 's/  */ /g'
perf report -i /tmp/lp_$2.data --no-children --sort sym 2>/dev/null | grep "^# Samples"
