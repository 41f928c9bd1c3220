"""Prefill and decode of the default model, MLX-op attention (before) against the fused
attention kernel (after), paired in one process.

Usage (repository root): python benchmarks/results/2026-12-03-prefill-attention/prefill_bench.py
[--repeats N] [--prompt-tokens 1500]. Prints one JSON line per measurement and a summary.
"""

# ruff: noqa: I001  (mtplx is imported first on purpose)
from __future__ import annotations

import mtplx  # noqa: F401  (first: the BLAS shim goes in before mlx loads)

import argparse
import itertools
import json
import os
import random
import statistics
import time

from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest, TokenEvent
from mtplx.sampling import SamplerConfig

GREEDY = SamplerConfig(temperature=0.0)


def _cpu() -> float:
    return time.process_time()


def _prompt(engine: Engine, seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(length)]


def _request(ids: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=ids, sampler=GREEDY, max_tokens=max_tokens, ignore_eos=True, depth=0
    )


def first_token(engine: Engine, ids: list[int]) -> dict[str, float]:
    """A prompt alone: seconds (wall, CPU) to its first token."""
    wall, cpu = time.perf_counter(), _cpu()
    sequence = engine.add(_request(ids, 1))
    while not sequence.finished:
        if any(isinstance(e, TokenEvent) for s, e in engine.step() if s is sequence):
            break
    result = {"ttft_s": time.perf_counter() - wall, "ttft_cpu_s": _cpu() - cpu}
    engine.abort(sequence)
    return result


def gap_while_admitted(engine: Engine, ids: list[int], stream_ids: list[int]) -> dict[str, float]:
    """A stream decodes; a long prompt arrives; the stream's longest gap between tokens until
    the long prompt's first token (and its median gap before the prompt came)."""
    stream = engine.add(_request(stream_ids, 4096))
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
    long = engine.add(_request(ids, 1))
    wall = time.perf_counter()
    while not any(isinstance(e, TokenEvent) for s, e in step() if s is long):
        pass
    ttft = time.perf_counter() - wall
    for _ in range(3):
        step()
    during = [b - a for a, b in itertools.pairwise(times[arrived - 1 :])]
    engine.abort(long)
    engine.abort(stream)
    return {
        "gap_max_s": max(during),
        "gap_p90_s": statistics.quantiles(during, n=10)[-1],
        "gap_median_s": statistics.median(during),
        "gap_median_before_s": statistics.median(before),
        "ttft_beside_stream_s": ttft,
    }


def decode_step(engine: Engine, ids: list[int], tokens: int = 32) -> dict[str, float]:
    """A stream alone, plain decoding: wall and CPU seconds per token (prompt excluded)."""
    sequence = engine.add(_request(ids, tokens + 1))
    marks: list[tuple[float, float]] = []
    while not sequence.finished:
        events = engine.step()
        if any(s is sequence and isinstance(e, TokenEvent) for s, e in events):
            marks.append((time.perf_counter(), _cpu()))
    engine.abort(sequence)
    (w0, c0), (w1, c1) = marks[0], marks[-1]
    count = len(marks) - 1
    return {"step_ms": (w1 - w0) / count * 1e3, "step_cpu_ms": (c1 - c0) / count * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    args = parser.parse_args()
    model = load(ensure_default_model())
    engines = {}
    for kind in ("mlx", "kernel"):
        os.environ["MTPLX_ATTENTION"] = kind  # read when the engine's SlotTarget is built
        engines[kind] = Engine(model)
        assert engines[kind].batched.attention == kind
    os.environ.pop("MTPLX_ATTENTION")
    for engine in engines.values():  # traces and MLX's fused kernels built once per shape
        first_token(engine, _prompt(engine, 99, 400))
        decode_step(engine, _prompt(engine, 98, 20), 4)
        gap_while_admitted(engine, _prompt(engine, 97, 300), _prompt(engine, 96, 30))
    results: dict[str, list[dict[str, float]]] = {k: [] for k in engines}
    for repeat in range(args.repeats):
        for kind, engine in engines.items():
            row: dict[str, float] = {"load": os.getloadavg()[0]}
            row.update(first_token(engine, _prompt(engine, repeat, args.prompt_tokens)))
            row.update(
                gap_while_admitted(
                    engine,
                    _prompt(engine, 100 + repeat, args.prompt_tokens),
                    _prompt(engine, 7, 30),
                )
            )
            row.update(decode_step(engine, _prompt(engine, 8, 30)))
            long_context = decode_step(engine, _prompt(engine, 9, args.prompt_tokens), 16)
            row.update({f"{k}_at_{args.prompt_tokens}": v for k, v in long_context.items()})
            row["load_after"] = os.getloadavg()[0]
            row["max_prefill_tokens"] = engine.batched.max_prefill_tokens
            results[kind].append(row)
            print(json.dumps({"repeat": repeat, "attention": kind, **row}), flush=True)
    for kind, rows in results.items():
        summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(json.dumps({"median": kind, **summary}), flush=True)


if __name__ == "__main__":
    main()
