"""In-process engine throughput and step profile (no HTTP): R rows decoding together.

Usage: PYTHONPATH=<checkout> python engine_bench.py --rows 1,8,16 --tokens 64 [--profile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mtplx  # noqa: F401  (enables the BLAS shim before mlx)
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig

PROMPTS = Path(__file__).resolve().parents[2] / "prompts" / "chat.jsonl"


def prompts(tokenizer, n: int) -> list[list[int]]:
    lines = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    out = []
    for i in range(n):
        item = lines[i % len(lines)]
        text = item.get("prompt") or item.get("text") or str(item)
        msgs = [{"role": "user", "content": text}]
        out.append(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
    return out


def run(engine: Engine, rows: int, tokens: int, temperature: float, drafter: str, depth):
    ids = prompts(engine.tokenizer, rows)
    seqs = [
        engine.add(
            GenerationRequest(
                ids[i],
                SamplerConfig(temperature=temperature, seed=1000 + i),
                max_tokens=tokens,
                ignore_eos=True,
                drafter=drafter,
                depth=depth,
            )
        )
        for i in range(rows)
    ]
    # Prefill until every row decodes, then time the steady state.
    while any(not s.prefilled for s in seqs):
        engine.step()
    step_times, emitted = [], 0
    started, cpu_started = time.perf_counter(), time.process_time()
    while engine.running:
        t0 = time.perf_counter()
        events = engine.step()
        step_times.append(time.perf_counter() - t0)
        emitted += sum(1 for _, e in events if type(e).__name__ == "TokenEvent")
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    return emitted / wall, statistics.median(step_times), cpu / emitted


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--drafter", default="none")
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    model = load(ensure_default_model())
    engine = Engine(model, max_num_seqs=16, default_depth=args.depth)
    run(engine, 1, 4, args.temperature, args.drafter, args.depth)  # warm-up
    for r in [int(x) for x in args.rows.split(",")]:
        for rep in range(args.repeats):
            if args.profile:
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.enable()
            tps, med, cpu_per_token = run(
                engine, r, args.tokens, args.temperature, args.drafter, args.depth
            )
            if args.profile:
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            print(
                f"rows={r} rep={rep} tok/s={tps:.1f} step_median_ms={med * 1e3:.1f} "
                f"cpu_ms_per_token={cpu_per_token * 1e3:.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
