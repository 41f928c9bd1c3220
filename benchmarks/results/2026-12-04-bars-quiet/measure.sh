#!/bin/bash
# Quiet-machine figures of the merged code, one command after the other (~20 min): the
# cycle and chat bars, greedy and T=0.6, plain vs llama.cpp, and the start-up calibration's
# time (a fresh one: the cached one is moved aside).   usage: measure.sh OUTDIR
set -x
OUT=$1; mkdir -p $OUT; cd /work/main
M=.venv/bin/mtplx
up() { echo "$1 $(uptime)" >> $OUT/load.txt; }
up start
.venv/bin/python benchmarks/cycle_ab.py --rounds 12 --kinds "plain,mtp@1 after,verify only" > $OUT/cycle_ab.txt 2>&1
up cycle_ab
.venv/bin/python benchmarks/cycle_ab.py --rounds 12 --temperature 0.6 --top-p 0.95 --top-k 20 --kinds "plain,mtp@1 after,verify only" > $OUT/cycle_ab_t06.txt 2>&1
up cycle_ab_t06
$M bench --quick --modes plain,default,mtp@1,llamacpp --out $OUT/bench-int8 > $OUT/bench-int8.log 2>&1
up bench-int8
$M bench --quick --samplers t0.6 --modes plain,default,mtp@1 --out $OUT/bench-t06 > $OUT/bench-t06.log 2>&1
up bench-t06
mkdir -p $OUT/calibration-aside; mv ~/.cache/mtplx/calibration/SmolLM2-135M-Instruct-*.json $OUT/calibration-aside/ 2>/dev/null
$M serve --port 8303 --log-level info > $OUT/serve.log 2>&1 &
for i in $(seq 1 600); do curl -s localhost:8303/health | grep -q '"status":"ok"' && break; sleep 1; done
up serve-started
$M bench-serve --url http://127.0.0.1:8303 --compare-plain --prompt-dir benchmarks/prompts-more --categories chat --temperatures 0 --max-tokens 96 --out $OUT/serve-compare > $OUT/serve-compare.log 2>&1
curl -s localhost:8303/health > $OUT/health.json
kill $(pgrep -f "mtplx serve --port 8303"); sleep 3
cp ~/.cache/mtplx/calibration/SmolLM2-135M-Instruct-*.json $OUT/ 2>/dev/null
up end
