#!/bin/bash
# Usage: unwritable_home.sh PORT MODEL_DIR [LIMIT_S]
# `mtplx serve MODEL_DIR` with MTPLX_HOME=/proc/mtplx-nope (cannot be created): seconds until
# /health answers 200 (or LIMIT_S), one chat request, SIGTERM; the log's warnings.
PORT=$1; MODEL=$2; LIMIT=${3:-900}
LOG=$(mktemp)
START=$(date +%s.%N)
MTPLX_HOME=/proc/mtplx-nope python -m mtplx serve "$MODEL" --port "$PORT" >"$LOG" 2>&1 &
PID=$!
READY=""
while kill -0 $PID 2>/dev/null; do
  if [ "$(curl -s -o /dev/null -w '%{http_code}' -m 2 localhost:$PORT/health)" = 200 ]; then
    READY=$(echo "$(date +%s.%N) - $START" | bc); break
  fi
  if [ "$(echo "$(date +%s.%N) - $START > $LIMIT" | bc)" = 1 ]; then break; fi
  sleep 1
done
echo "ready after: ${READY:-not within ${LIMIT}s} s (load $(cut -d' ' -f1-3 /proc/loadavg))"
if [ -n "$READY" ]; then
  curl -s -m 120 localhost:$PORT/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model":"SmolLM2-135M-Instruct","max_tokens":16,"messages":[{"role":"user","content":"Name three colors."}]}' \
    | python -c 'import json,sys; d=json.load(sys.stdin); print("reply:", repr(d["choices"][0]["message"]["content"]))'
  curl -s -m 5 localhost:$PORT/health | python -c 'import json,sys; print("health blas:", json.load(sys.stdin)["blas"])'
fi
kill -TERM $PID; wait $PID; echo "exit code $?"
echo "--- log (warnings, calibration, builds)"
grep -E "WARNING|warning|cannot|BLAS|build|step costs|measuring|dequantized" "$LOG" | grep -v access | cut -c1-260
rm -f "$LOG"
