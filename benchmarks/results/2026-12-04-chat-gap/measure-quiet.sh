#!/bin/bash
# On a quiet host: does a request's depth-1 MTP step cost what the steady-state median says
# (cycle_ab.py, the calibration: 1.14-1.18x quiet) or what the quiet pass's records imply
# (~1.34x)? One command after the other, the load before each; output under $1.
set -eux
OUT=${1:-quiet}
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$OUT"
export PYTHONPATH=$ROOT
PY=${PY:-$ROOT/.venv/bin/python}
uptime > "$OUT/load.txt"
$PY "$ROOT/benchmarks/cycle_ab.py" --rounds 12 --tokens 96 --kinds "plain,mtp@1 after" > "$OUT/cycle_ab.txt"
uptime >> "$OUT/load.txt"
$PY "$(dirname "$0")/decompose.py" --modes plain,default,mtp@1 --tokens 96 --repeats 2 --out "$OUT"
uptime >> "$OUT/load.txt"
$PY "$(dirname "$0")/summarize.py" "$OUT/steps.jsonl" > "$OUT/summary.md"
$PY "$(dirname "$0")/planner_choices.py" "$OUT/steps.jsonl" > "$OUT/planner.md"
