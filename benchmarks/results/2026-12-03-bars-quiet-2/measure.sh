#!/bin/bash
# Quiet-machine figures of the merged code, one command after the other (~8 min).
# usage: measure.sh OUTDIR
set -x
OUT=$1; mkdir -p $OUT; cd /work/main
uptime > $OUT/load.txt
.venv/bin/python benchmarks/results/2026-12-03-mtp-cycle-3/cycle_ab.py --rounds 12 --before 38327e3 > $OUT/cycle_ab.txt 2>&1
uptime >> $OUT/load.txt
.venv/bin/mtplx bench --quick --modes plain,default,mtp@1,llamacpp --out $OUT/bench-int8 > $OUT/bench-int8.log 2>&1
uptime >> $OUT/load.txt
.venv/bin/mtplx bench --prompt-dir benchmarks/prompts-more --categories chat --prompts-per-category 12 --max-tokens 96 --repeats 1 --samplers greedy --modes plain,default,mtp@1 --out $OUT/bench-chat-in-process > $OUT/bench-chat-in-process.log 2>&1
uptime >> $OUT/load.txt
.venv/bin/mtplx serve --port 8303 > $OUT/serve.log 2>&1 &
for i in $(seq 1 600); do curl -s localhost:8303/health | grep -q '"status":"ok"' && break; sleep 1; done
.venv/bin/mtplx bench-serve --url http://127.0.0.1:8303 --compare-plain --prompt-dir benchmarks/prompts-more --categories chat --temperatures 0 --max-tokens 96 --out $OUT/serve-compare > $OUT/serve-compare.log 2>&1
curl -s localhost:8303/health > $OUT/health.json
kill $(pgrep -f "mtplx serve --port 8303"); sleep 3
uptime >> $OUT/load.txt
