#!/bin/bash
# s13: the adaptive policy with an optimistic first-position estimate (this commit) against the
# one before (worktree at c3e062b, the same code but the policy), one server after the other.
OUT=${OUT:-/work/main/benchmarks/results/2026-12-02-s13/policy}
for side in main span; do
  cd /work/$side
  PYTHONPATH=/work/$side /work/main/.venv/bin/python -m mtplx serve --port 8013 > $OUT/server-$side.log 2>&1 &
  SERVER=$!
  for i in $(seq 1 300); do curl -sf http://127.0.0.1:8013/health >/dev/null && break; sleep 1; done
  B="/work/main/.venv/bin/mtplx bench-serve --url http://127.0.0.1:8013 --compare-plain"
  $B --prompt-dir /work/main/benchmarks/prompts-more --categories chat --temperatures 0,0.6 --repeats 1 --max-tokens 96 --out $OUT/$side-chat > $OUT/$side-chat.log 2>&1
  $B --prompt-dir /work/main/benchmarks/prompts --categories chat,code,repeat,summarize --temperatures 0,0.6 --repeats 1 --max-tokens 128 --out $OUT/$side-categories > $OUT/$side-categories.log 2>&1
  kill $SERVER; wait $SERVER
done
date > $OUT/done
