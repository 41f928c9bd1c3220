#!/bin/bash
# End-to-end, before (BEFORE_TREE: the code before this change, its own MTPLX_HOME) against
# after (this worktree, its own MTPLX_HOME): both servers up at once (started one after the
# other, each calibrating at start-up), then chat default-vs-plain over HTTP on each, turn
# about (ROUNDS runs of the 12 chat prompts each), then the in-process chat bench of each.
# usage: e2e.sh OUTDIR BEFORE_TREE BEFORE_HOME AFTER_TREE AFTER_HOME ROUNDS [IN_PROCESS]
# (IN_PROCESS 0: the HTTP comparison only)
set -x
OUT=$1; BT=$2; BH=$3; AT=$4; AH=$5; ROUNDS=${6:-2}; IN_PROCESS=${7:-1}
PY=/work/main/.venv/bin/python
mkdir -p $OUT
uptime > $OUT/load.txt
serve() {  # tree home port name
  (cd $1 && MTPLX_HOME=$2 PYTHONPATH=$1 exec nice -n 5 $PY -m mtplx serve --port $3) > $OUT/serve-$4.log 2>&1 &
  echo $! > $OUT/serve-$4.pid
  for i in $(seq 1 900); do curl -s localhost:$3/health | grep -q '"status":"ok"' && break; sleep 1; done
  uptime >> $OUT/load.txt
}
serve $BT $BH 8411 before
serve $AT $AH 8412 after
for r in $(seq 1 $ROUNDS); do
  for side in before after; do
    port=8411; [ $side = after ] && port=8412
    (cd $AT && PYTHONPATH=$AT nice -n 5 $PY -m mtplx bench-serve --url http://127.0.0.1:$port --compare-plain --prompt-dir benchmarks/prompts-more --categories chat --temperatures 0 --max-tokens 96 --repeats 1 --out $OUT/serve-compare-$side-$r) > $OUT/serve-compare-$side-$r.log 2>&1
    uptime >> $OUT/load.txt
  done
done
curl -s localhost:8411/health > $OUT/health-before.json
curl -s localhost:8412/health > $OUT/health-after.json
kill $(cat $OUT/serve-before.pid) $(cat $OUT/serve-after.pid); sleep 3
[ "$IN_PROCESS" = 0 ] && exit 0
for side in before after; do
  T=$BT; H=$BH; [ $side = after ] && T=$AT && H=$AH
  (cd $T && MTPLX_HOME=$H PYTHONPATH=$T nice -n 5 $PY -m mtplx bench --prompt-dir benchmarks/prompts-more --categories chat --prompts-per-category 12 --max-tokens 96 --repeats 1 --samplers greedy --modes plain,default,mtp@1 --out $OUT/bench-chat-$side) > $OUT/bench-chat-$side.log 2>&1
  uptime >> $OUT/load.txt
done
