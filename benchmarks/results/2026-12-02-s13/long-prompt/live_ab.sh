#!/bin/bash
# $1 = code dir (before / main)
cd $1
PYTHONPATH=$1 /work/main/.venv/bin/python -m mtplx serve --port 8021 > /work/runs/s13/server_$(basename $1).log 2>&1 &
SERVER=$!
for i in $(seq 1 300); do curl -sf http://127.0.0.1:8021/health >/dev/null && break; sleep 1; done
/work/main/.venv/bin/python /work/runs/s13/long_then_short.py 8021 $SERVER
kill $SERVER; wait
