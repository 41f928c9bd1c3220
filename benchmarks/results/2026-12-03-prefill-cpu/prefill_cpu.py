"""A 1,500-token prompt's first token alone on the default model, with its CPU seconds, page
faults and context switches (getrusage, every thread of the process counted).

Usage (repository root): python benchmarks/results/2026-12-03-prefill-cpu/prefill_cpu.py
[--repeats N] [--tokens 1500] [--cprofile FILE] [--pause S] [--gap]. One warm-up prompt of 400
tokens first; --gap: then a decoding stream's gaps between tokens while such a prompt is fed
beside it (prompt chunks of ``prefill_chunk_size`` tokens), until its first token.
"""

# ruff: noqa: I001  (mtplx is imported first on purpose)
from __future__ import annotations

import mtplx  # noqa: F401  (first: the BLAS shim goes in before mlx loads)

import argparse
import cProfile
import itertools
import json
import os
import random
import resource
import statistics
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


def gap_while_admitted(engine: Engine, seed: int, n: int) -> dict:
    """A stream decodes (30-token prompt); a prompt of n tokens arrives: the stream's gaps
    between tokens from then until that prompt's first token, and before it came."""

    def request(ids: list[int], max_tokens: int) -> GenerationRequest:
        return GenerationRequest(
            prompt_ids=ids,
            sampler=SamplerConfig(temperature=0.0),
            max_tokens=max_tokens,
            ignore_eos=True,
            depth=0,
        )

    rng = random.Random(seed)
    stream = engine.add(request([rng.randrange(1000, 40000) for _ in range(30)], 4096))
    times: list[float] = []

    def step() -> list:
        events = engine.step()
        now = time.perf_counter()
        times.extend(now for s, e in events if s is stream and isinstance(e, TokenEvent))
        return events

    while len(times) < 12:
        step()
    before = [b - a for a, b in itertools.pairwise(times[4:])]
    arrived = len(times)
    long = engine.add(request([rng.randrange(1000, 40000) for _ in range(n)], 1))
    wall, cpu = time.perf_counter(), time.process_time()
    while not any(isinstance(e, TokenEvent) for s, e in step() if s is long):
        pass
    ttft, ttft_cpu = time.perf_counter() - wall, time.process_time() - cpu
    for _ in range(3):
        step()
    during = [b - a for a, b in itertools.pairwise(times[arrived - 1 :])]
    engine.abort(long)
    engine.abort(stream)
    return {
        "tokens": n,
        "gap_max_s": round(max(during), 3),
        "gap_p90_s": round(statistics.quantiles(during, n=10)[-1], 3),
        "gap_median_s": round(statistics.median(during), 3),
        "gap_median_before_s": round(statistics.median(before), 3),
        "ttft_beside_stream_s": round(ttft, 3),
        "ttft_beside_stream_cpu_s": round(ttft_cpu, 3),
        "activations": os.environ.get("MTPLX_ACTIVATIONS", "float32"),
        "load": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--cprofile", default=None)
    parser.add_argument("--gap", action="store_true", help="also a stream's gaps beside the prompt")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds to wait (attach perf)")
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
    if args.gap:
        gap_while_admitted(engine, 99, 300)  # the beside-a-stream shapes traced once
        for i in range(args.repeats):
            print(json.dumps(gap_while_admitted(engine, 200 + i, args.tokens)), flush=True)


if __name__ == "__main__":
    main()
