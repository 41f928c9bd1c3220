"""Where the default configuration's chat time goes, in process: every engine step of every
request logged (the row's plan, how the schedule ran it, whether a forward ran, what it
committed, its wall / thread CPU / process CPU), modes turn about per prompt, order rotating.

    PYTHONPATH=. python decompose.py --modes plain,default,mtp@1 --tokens 96 --out DIR

Writes DIR/steps.jsonl (one line per run: the run's bench figures and its steps) and prints
a summary (summarize.py reads steps.jsonl again).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

# ruff: noqa: I001
import mtplx  # noqa: E402,F401

from mtplx.bench.backends import Mode, run_ours  # noqa: E402
from mtplx.bench.prompts import encode_prompt, load_prompts  # noqa: E402
from mtplx.engine import Engine  # noqa: E402
from mtplx.models import load  # noqa: E402
from mtplx.models.gguf import ensure_default_model  # noqa: E402
from mtplx.sampling import SamplerConfig  # noqa: E402

MODES = {
    "plain": Mode("plain", "ours", "none", 0),
    "default": Mode("default", "ours", None, None),
    "mtp@1": Mode("mtp@1", "ours", "mtp", 1),
    "mtp@2": Mode("mtp@2", "ours", "mtp", 2),
    "mtp-adaptive": Mode("mtp-adaptive", "ours", "mtp", None),
}


class StepLog:
    """Wraps one engine's step phases to log each step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.steps: list[dict] = []
        self.current: dict = {}
        plans, schedule, execute = engine._plans, engine._schedule, engine._execute
        close_q, close_a = engine._close_queued, engine._close_ahead
        step = engine.step

        def _plans(events):
            out = plans(events)
            self.current["plans"] = [(p.source, p.num_draft) for p in out.values()]
            return out

        def _schedule(plans_, events):
            batch = schedule(plans_, events)
            self.current["groups"] = [len(batch.plain), len(batch.drafting), len(batch.ahead)]
            return batch

        def _execute(batch, inputs, events):
            self.current["forward"] = self.current.get("forward", 0) + 1
            self.current["chunks"] = len(batch.chunks)
            return execute(batch, inputs, events)

        def _close_queued(sequence, events):
            self.current["close_queued"] = self.current.get("close_queued", 0) + 1
            return close_q(sequence, events)

        def _close_ahead(sequence, events, started=None):
            self.current["close_ahead"] = self.current.get("close_ahead", 0) + 1
            return close_a(sequence, events, started)

        def _step():
            self.current = {}
            w, p, t = time.perf_counter(), time.process_time(), time.thread_time()
            events = step()
            self.current["wall"] = time.perf_counter() - w
            self.current["proc"] = time.process_time() - p
            self.current["thread"] = time.thread_time() - t
            self.current["tokens"] = sum(1 for _, e in events if hasattr(e, "token_id"))
            self.current["drafted"] = sum(1 for _, e in events if getattr(e, "drafted", False))
            self.steps.append(self.current)
            return events

        engine._plans = _plans
        engine._schedule = _schedule
        engine._execute = _execute
        engine._close_queued = _close_queued
        engine._close_ahead = _close_ahead
        engine.step = _step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="plain,default,mtp@1")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--prompt-dir", default=str(ROOT / "benchmarks/prompts-more"))
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.modes.split(",")
    loaded = load(ensure_default_model("native"))
    engine = Engine(loaded)
    engine.warm_up()
    (out / "costs.json").write_text(json.dumps(engine.costs.to_dict(), indent=1))
    engines = {"": engine}
    if any(n.endswith("+pc") for n in names):
        # What `mtplx serve` builds: a prefix cache (hidden states kept), the same costs.
        served = Engine(loaded, prefix_cache_bytes=1 << 30)
        served.costs, served.calibrated = engine.costs, True
        engines["+pc"] = served
    modes = []
    for n in names:
        base, suffix = (n[:-3], "+pc") if n.endswith("+pc") else (n, "")
        m = MODES[base]
        modes.append((Mode(m.name + suffix, m.backend, m.drafter, m.depth), engines[suffix]))
    logs = {id(e): StepLog(e) for e in engines.values()}
    prompts = load_prompts(Path(args.prompt_dir), ["chat"], args.prompts)
    encoded = {p.prompt_id: encode_prompt(loaded.tokenizer, p.text) for p in prompts}
    greedy = SamplerConfig(temperature=0.0)
    first = encoded[prompts[0].prompt_id]
    for mode, eng in modes:  # warm-up
        run_ours(eng, mode, first, greedy, 8)
    print("load before", os.getloadavg(), flush=True)
    with (out / "steps.jsonl").open("w") as f:
        turn = 0
        for repeat in range(args.repeats):
            for prompt in prompts:
                order = modes[turn % len(modes) :] + modes[: turn % len(modes)]
                turn += 1
                for mode, eng in order:
                    log = logs[id(eng)]
                    log.steps = []
                    p0 = time.process_time()
                    result = run_ours(eng, mode, encoded[prompt.prompt_id], greedy, args.tokens)
                    record = {
                        "mode": mode.name,
                        "prompt_id": prompt.prompt_id,
                        "repeat": repeat,
                        "tokens": result.tokens,
                        "ttft": result.ttft,
                        "decode_time": result.decode_time,
                        "decode_tps": result.decode_tps,
                        "proc": time.process_time() - p0,
                        "load": os.getloadavg()[0],
                        "token_ids": result.token_ids,
                        "steps": log.steps,
                    }
                    f.write(json.dumps(record) + "\n")
                    f.flush()
    print("load after", os.getloadavg(), flush=True)


if __name__ == "__main__":
    main()
