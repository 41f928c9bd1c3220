#!/bin/bash
# Count the server main thread's socket sends for one default and one plain reply.
for spec in "A 338 8423" "B 337 8424"; do
  set -- $spec
  for kind in default plain; do
    timeout 60 strace -f -e trace=sendto,write,sendmsg -p $2 -o /tmp/strace-$1-$kind.txt 2>/dev/null &
    ST=$!; sleep 1
    /work/main/.venv/bin/python - $3 $kind <<'PY'
import httpx, json, sys
port, kind = sys.argv[1], sys.argv[2]
c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
model = c.get("/v1/models").json()["data"][0]["id"]
body = {"model": model, "messages": [{"role": "user", "content": "Why do leaves change color in the autumn?"}], "max_tokens": 96, "temperature": 0, "stream": True}
if kind == "plain":
    body["mtplx"] = {"depth": 0}
with c.stream("POST", "/v1/chat/completions", json=body) as r:
    for _ in r.iter_lines():
        pass
PY
    sleep 0.5; kill -INT $ST; wait $ST 2>/dev/null
    echo "$1 $kind: sends $(grep -c 'sendto\|sendmsg\|^[0-9]* *write(' /tmp/strace-$1-$kind.txt) (data: chunks $(grep -c 'data: {' /tmp/strace-$1-$kind.txt))"
  done
done
