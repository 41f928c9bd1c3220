#!/bin/bash
# SIGTERM (or SIGINT: $2) a live server while streams wait, run and prefill; each stream's tail
# and the server's exit status. Usage: attack_sigterm.sh PORT [TERM|INT]
PORT=$1; SIG=${2:-TERM}; DIR=$(mktemp -d)
cd "$(git rev-parse --show-toplevel)"
PYTHONPATH=$PWD /work/main/.venv/bin/python -m mtplx serve --port $PORT --max-num-seqs 2 > $DIR/server.log 2>&1 &
SPID=$!
for i in $(seq 60); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
for i in 0 1 2 3 4; do
  if [ $i -lt 2 ]; then TEXT="Tell me a long story about the sea."; else TEXT="$(printf 'word %.0s' $(seq 1500))"; fi
  curl -sN localhost:$PORT/v1/chat/completions -H 'content-type: application/json' \
    -d "{\"model\":\"SmolLM2-135M-Instruct\",\"stream\":true,\"max_tokens\":400,\"messages\":[{\"role\":\"user\",\"content\":\"$TEXT\"}]}" > $DIR/s$i.txt 2>&1 &
done
sleep 3
kill -$SIG $SPID; wait $SPID; echo "server exit: $?"
sleep 1
for i in 0 1 2 3 4; do N=$(grep -c '^data: ' $DIR/s$i.txt); echo "stream $i: $N data lines"; tail -c 300 $DIR/s$i.txt | tr '\n' ' '; echo; done
tail -3 $DIR/server.log
