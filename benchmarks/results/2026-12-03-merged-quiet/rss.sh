#!/bin/bash
# usage: rss.sh WEIGHTS PORT
cd /work/main
.venv/bin/mtplx serve --weights $1 --port $2 > /tmp/rss-$1.log 2>&1 &
PID=$!
for i in $(seq 1 600); do curl -s localhost:$2/health | grep -q "\"status\":\"ok\"" && break; sleep 1; done
for i in 1 2 3 4 5; do
curl -s localhost:$2/v1/chat/completions -H 'content-type: application/json' -d '{"model":"SmolLM2-135M-Instruct","messages":[{"role":"user","content":"Tell me about cats number '$i'."}],"max_tokens":48,"temperature":0}' > /dev/null
done
echo "$1 RSS_MB $(( $(grep VmRSS /proc/$PID/status | awk '{print $2}') / 1024 )) HWM_MB $(( $(grep VmHWM /proc/$PID/status | awk '{print $2}') / 1024 ))"
curl -s localhost:$2/health | head -c 600; echo
kill $PID; wait $PID 2>/dev/null
