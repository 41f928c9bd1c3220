"""A 1,500-token prompt's first token alone on the default model, with its CPU seconds, page
faults and context switches (getrusage, every thread of the process counted).

Usage (repository root): python benchmarks/results/2026-12-03-prefill-cpu/prefill_cpu.py
[--repeats N] [--tokens 1500] [--cprofile FILE]. One warm-up prompt of 400 tokens first.
"""

# ruff: noqa: I001  (mtplx is imported first on purpose)
from __future__ import annotations

import mtplx  # noqa: F401  (first: the BLAS shim goes in before mlx loads)

import argparse
import cProfile
import json
import os
import random
import resource
import time

from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest, TokenEvent
from mtplx.sampling import SamplerConfig


def thread_cpu() -> dict[int, float]:
    """CPU seconds of each live thread of this process (utime + stime from /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks
    return seconds


def first_token(engine: Engine, seed: int, n: int, profile: cProfile.Profile | None) -> dict:
    """One prompt of n random tokens alone: wall and CPU seconds to its first token."""
    rng = random.Random(seed)
    ids = [rng.randrange(1000, 40000) for _ in range(n)]
    request = GenerationRequest(
        prompt_ids=ids,
        sampler=SamplerConfig(temperature=0.0),
        max_tokens=1,
        ignore_eos=True,
        depth=0,
    )
    sequence = engine.add(request)
    before = resource.getrusage(resource.RUSAGE_SELF)
    threads_before = thread_cpu()
    wall, cpu, steps = time.perf_counter(), time.process_time(), 0
    if profile is not None:
        profile.enable()
    while not sequence.finished:
        steps += 1
        if any(isinstance(e, TokenEvent) for s, e in engine.step() if s is sequence):
            break
    if profile is not None:
        profile.disable()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = resource.getrusage(resource.RUSAGE_SELF)
    threads_after = thread_cpu()
    # The busiest thread (MLX's CPU stream: every kernel call starts there): on an idle
    # machine the first token cannot come sooner than its CPU seconds.
    busiest = max(t - threads_before.get(tid, 0.0) for tid, t in threads_after.items())
    engine.abort(sequence)
    return {
        "tokens": n,
        "ttft_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "busiest_thread_cpu_s": round(busiest, 2),
        "minor_faults": after.ru_minflt - before.ru_minflt,
        "voluntary_switches": after.ru_nvcsw - before.ru_nvcsw,
        "involuntary_switches": after.ru_nivcsw - before.ru_nivcsw,
        "steps": steps,
        "activations": os.environ.get("MTPLX_ACTIVATIONS", "float32"),
        "load": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--cprofile", default=None)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds to wait after the warm-up (to attach perf)")
    args = parser.parse_args()
    engine = Engine(load(ensure_default_model()))
    first_token(engine, 1, 400, None)
    print("READY", os.getpid(), flush=True)
    time.sleep(args.pause)
    profile = cProfile.Profile() if args.cprofile else None
    for i in range(args.repeats):
        print(json.dumps(first_token(engine, 10 + i, args.tokens, profile)), flush=True)
    if profile is not None:
        profile.dump_stats(args.cprofile)


if __name__ == "__main__":
    main()
