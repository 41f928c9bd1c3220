#!/bin/bash
# Usage: corrupt_cache.sh CODE_ROOT PORT CACHE_PATH MODEL_DIR CASE...
# For each CASE, writes a calibration cache file at CACHE_PATH (the path `mtplx serve
# MODEL_DIR` reads, printed by cache_path.py), starts `mtplx serve MODEL_DIR` from
# CODE_ROOT (PYTHONPATH), waits until /health is 200 or the process ends, and reports the
# outcome with the calibration log lines.
ROOT=$1; PORT=$2; CACHE=$3; MODEL=$4; shift 4
mkdir -p "$(dirname "$CACHE")"
for CASE in "$@"; do
  case $CASE in
    another_version) echo '{"version": 2, "model": "SmolLM2-135M-Instruct", "key": "'"$(basename "$CACHE" .json | sed 's/.*-//')"'", "costs": {"batch_sizes": [1, 4, 8, 16], "plain": [0.0176, 0.0288, 0.0472, 0.0805], "per_token": [0.0027, 0.0146, 0.0315, 0.0719], "sync": [0.0, 0.0, 0.0, 0.0], "drafting": {"mtp": [0.0, 0.001, 0.0043, 0.0076, 0.0109, 0.0142]}}}' > "$CACHE";;
    another_engine_shape) echo '{"batch_sizes": [1, 4], "plain": [0.0176, 0.0288], "per_token": [0.0027, 0.0146], "sync": [0.0, 0.0], "drafting": {}}' > "$CACHE";;
    truncated) echo -n '{"batch_sizes": [1, 4, 8, 16], "plain": [0.0176, 0.02' > "$CACHE";;
    strings) echo '{"batch_sizes": [1, 4, 8, 16], "plain": ["fast", "x", "y", "z"], "per_token": [0, 0, 0, 0], "sync": [0, 0, 0, 0], "drafting": {"mtp": [0, 0, 0, 0, 0, 0]}}' > "$CACHE";;
  esac
  LOG=$(mktemp)
  START=$(date +%s.%N)
  (cd "$ROOT" && exec env PYTHONPATH=$ROOT python -m mtplx serve "$MODEL" --port "$PORT" --log-level info) >"$LOG" 2>&1 &
  PID=$!
  STATUS="exited"
  while kill -0 $PID 2>/dev/null; do
    if [ "$(curl -s -o /dev/null -w '%{http_code}' -m 2 localhost:$PORT/health)" = 200 ]; then STATUS="ready"; break; fi
    sleep 1
  done
  T=$(echo "$(date +%s.%N) - $START" | bc)
  if [ $STATUS = ready ]; then kill -TERM $PID; fi
  wait $PID; RC=$?
  echo "== $CASE: $STATUS after ${T}s (exit code $RC; load $(cut -d' ' -f1-3 /proc/loadavg))"
  grep -E "mtplx.calibration|failed to load|Error" "$LOG" | cut -c1-240 | sed 's/^/   /'
  rm -f "$LOG" "$CACHE"
done
