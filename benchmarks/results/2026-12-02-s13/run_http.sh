#!/bin/bash
# s13 bar measurements over HTTP: a server as `make serve` starts it, then the compare tool.
cd /work/main
OUT=${OUT:-benchmarks/results/2026-12-02-s13}
.venv/bin/mtplx serve --port 8013 > $OUT/server.log 2>&1 &
SERVER=$!
for i in $(seq 1 300); do curl -sf http://127.0.0.1:8013/health >/dev/null && break; sleep 1; done
date > $OUT/started
B=".venv/bin/mtplx bench-serve --url http://127.0.0.1:8013 --compare-plain"
$B --prompt-dir benchmarks/prompts-more --categories chat --temperatures 0,0.6 --repeats 1 --max-tokens 96 --out $OUT/chat-default > $OUT/chat-default.log 2>&1
$B --prompt-dir benchmarks/prompts-more --categories chat --temperatures 0 --repeats 1 --max-tokens 96 --drafter mtp --depth 1 --out $OUT/mtp1 > $OUT/mtp1.log 2>&1
kill $SERVER; wait
date > $OUT/done
