#!/bin/bash
# Usage: sigterm_during_calibration.sh TERM|INT PORT [DELAY]
# Starts `mtplx serve` with an empty calibration cache, sends the signal DELAY seconds after
# the log says the step costs are being measured, and reports how long the process
# took to exit, its exit code, and what the calibration cache directory holds.
SIG=${1:-TERM}; PORT=${2:-8940}; DELAY=${3:-5}
LOG=$(mktemp)
rm -rf "$MTPLX_HOME/calibration"
python -m mtplx serve --port "$PORT" >"$LOG" 2>&1 &
PID=$!
# the engine thread logs the BLAS line before calibration; wait for /health to say loading
until grep -q "measuring the step costs" "$LOG"; do sleep 0.2; kill -0 $PID || break; done
sleep "$DELAY"
echo "health before: $(curl -s -m 2 localhost:$PORT/health | head -c 40)"
START=$(date +%s.%N)
kill -"$SIG" "$PID"
wait "$PID"; RC=$?
END=$(date +%s.%N)
echo "signal SIG$SIG after ${DELAY}s of loading: exit code $RC, exited $(echo "$END - $START" | bc) s after the signal"
echo "calibration cache: $(ls -A "$MTPLX_HOME/calibration" 2>/dev/null | tr '\n' ' ')"
echo "--- server log (tail)"; tail -6 "$LOG" | cut -c1-200
rm -f "$LOG"
