#!/bin/bash
# Quiet-machine figures of the merged code, one command after the other (~15 min).
# usage: measure.sh OUTDIR   (prefill_ttft.py and rss.sh are in ../2026-12-03-merged-quiet/)
set -x
OUT=$1; mkdir -p $OUT; cd /work/main
Q=benchmarks/results/2026-12-03-merged-quiet
uptime > $OUT/load.txt
.venv/bin/python benchmarks/cycle_ab.py --rounds 12 --kinds "plain,mtp@1 after,verify only" > $OUT/cycle_ab.txt 2>&1
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
.venv/bin/python scripts/quant_bench.py --repeats 3 --tokens 64 > $OUT/quant_bench.txt 2>&1
uptime >> $OUT/load.txt
.venv/bin/python $Q/prefill_ttft.py 3 > $OUT/prefill-int8.txt 2>&1
$Q/rss.sh native 8301 > $OUT/rss.txt 2>&1
uptime >> $OUT/load.txt
