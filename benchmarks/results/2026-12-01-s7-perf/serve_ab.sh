#!/usr/bin/env bash
# Paired HTTP runs: for each pass, start a server from a checkout, run bench-serve at
# c=1,8,16 (T=0.7, 96 tokens, one wave per level), record the server threads' CPU, stop it.
# Usage: serve_ab.sh OUTDIR PASSES name=checkout [name=checkout ...]
set -u
out=$1; passes=$2; shift 2
py=/work/main/.venv/bin/python
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
for pass in $(seq 1 "$passes"); do
  for spec in "$@"; do
    name=${spec%%=*}; tree=${spec#*=}; port=$((8730 + pass))
    PYTHONPATH=$tree $py -m mtplx serve --port $port --log-level warning > "$out/$name-$pass.server.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 240); do
      curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1
    done
    uptime > "$out/$name-$pass.uptime"
    $py "$here/thread_cpu.py" $pid > "$out/$name-$pass.threads-before"
    PYTHONPATH=/work/wt-perf $py -m mtplx bench-serve --url "http://127.0.0.1:$port" \
      --concurrency 1,8,16 --max-tokens 96 --temperature 0.7 --out "$out/$name-$pass" \
      > "$out/$name-$pass.bench.log" 2>&1
    $py "$here/thread_cpu.py" $pid > "$out/$name-$pass.threads-after"
    uptime >> "$out/$name-$pass.uptime"
    kill -TERM $pid; wait $pid
  done
done
