"""In-process figures for the quantized path against float32 on the default model.

Loads the default model in both formats (``native``: the GGUF's Q4_1 / Q8_0 weights on the
batch-invariant kernel; ``f32``: dequantized), then, for each, in the same run and
interleaved so that the machine's load hits both alike:

- single-stream plain decoding (tokens/s, decode only: prompt time excluded), and the
  process's CPU time per token;
- 16 concurrent streams of plain decoding (aggregate tokens/s, CPU time per token);
- a depth-1 MTP cycle's cost against a plain step (ms per engine step, MTP drafter);
- the quantized products of one token alone (the kernel's share of a step).

Prints a markdown table (medians over repeats) and the load average before and after.

    python scripts/quant_bench.py [--repeats 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mtplx  # noqa: F401  (enables the BLAS shim before MLX loads)
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.quant import quant_info
from mtplx.request import GenerationRequest, SamplerConfig, TokenEvent

GREEDY = SamplerConfig(temperature=0.0)
PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that checks whether a number is prime.",
    "List three tips for a good night's sleep.",
    "Describe a cat to someone who has never seen one.",
]


def _ids(engine: Engine, text: str) -> list[int]:
    return list(
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
    )


def _request(engine: Engine, i: int, tokens: int, drafter: str, depth: int) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=_ids(engine, PROMPTS[i % len(PROMPTS)]),
        sampler=GREEDY,
        max_tokens=tokens,
        ignore_eos=True,
        drafter=drafter,
        depth=depth,
    )


def decode_rate(
    engine: Engine, streams: int, tokens: int, drafter: str = "none"
) -> tuple[float, float]:
    """(Aggregate decode tokens/s, this process's CPU ms per token) of ``streams``
    sequences, from the first token (prefill excluded) to the end. CPU time counts every
    thread of the process, the kernel's helpers included: on a machine shared with other
    work it moves less with the load than wall-clock time does."""
    for i in range(streams):
        engine.add(_request(engine, i, tokens, drafter, 0 if drafter == "none" else 1))
    first: float | None = None
    cpu_first = 0.0
    counted = 0
    while engine.running:
        events = engine.step()
        now = time.perf_counter()
        new = sum(1 for _, e in events if isinstance(e, TokenEvent))
        if first is None:
            if new:
                first, cpu_first = now, time.process_time()
            continue
        counted += new
    assert first is not None
    cpu_ms = 1e3 * (time.process_time() - cpu_first) / max(counted, 1)
    return counted / (time.perf_counter() - first), cpu_ms


def step_ms(engine: Engine, drafter: str, depth: int, tokens: int) -> float:
    """Median milliseconds of one engine step for a single stream."""
    engine.add(_request(engine, 0, tokens, drafter, depth))
    times = []
    engine.step()  # prefill
    while engine.running:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[2:] or times)


def products_ms(model: object, repeats: int = 20) -> float:
    """CPU milliseconds of one token's quantized products alone, one thread: every product
    of the trunk and the LM head on a single row, no other op, in the process's activations
    mode (``MTPLX_ACTIVATIONS``). A step can cost no less on
    this machine; how far above it a step is measures everything else."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mtplx import quant
    from mtplx.models.quantized import (
        InvariantQuantizedEmbedding,
        InvariantQuantizedLinear,
        activations_format,
    )

    # The module holding the trunk and its LM head (a tied embedding serves as the head).
    owner = getattr(getattr(model.target, "trunk", None), "owner", None)  # type: ignore[attr-defined]
    if owner is None or not quant.loaded():
        return float("nan")
    weights = [
        layer.quant
        for _, layer in tree_flatten(owner.leaf_modules(), is_leaf=nn.Module.is_module)
        if isinstance(layer, InvariantQuantizedLinear | InvariantQuantizedEmbedding)
    ]
    inputs = [mx.ones((1, w.shape[1])) for w in weights]
    mx.eval(inputs)
    before = quant.quant_info().threads or 1
    quant.set_threads(1)
    try:
        times = []
        for _ in range(repeats):
            start = time.process_time()
            products = [
                quant.qmm(x, *w.arrays, w.bits, w.group_size, activations_format())
                for x, w in zip(inputs, weights, strict=True)
            ]
            mx.eval(products)
            times.append(time.process_time() - start)
    finally:
        quant.set_threads(before)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    engines, models = {}, {}
    for fmt in ("native", "f32"):
        model = load(ensure_default_model(fmt), dequantize=fmt == "f32")
        models[fmt] = model
        engines[fmt] = Engine(model)
        engines[fmt].warm_up()
        print(f"{fmt}: {model.weights}")
    from mtplx.models.quantized import activations_format

    print(
        f"kernel: {quant_info().kernel} ({activations_format()} activations); "
        f"load before: {os.getloadavg()}"
    )
    rows: dict[str, dict[str, list[float]]] = {f: {} for f in engines}
    for _ in range(args.repeats):
        for fmt, engine in engines.items():
            r = rows[fmt]
            rate, cpu = decode_rate(engine, 1, args.tokens)
            r.setdefault("plain 1 stream tok/s", []).append(rate)
            r.setdefault("plain 1 stream CPU ms/token", []).append(cpu)
            rate, cpu = decode_rate(engine, 16, args.tokens)
            r.setdefault("plain 16 streams tok/s (aggregate)", []).append(rate)
            r.setdefault("plain 16 streams CPU ms/token", []).append(cpu)
            plain = step_ms(engine, "none", 0, args.tokens)
            mtp = step_ms(engine, "mtp", 1, args.tokens)
            r.setdefault("plain step ms", []).append(plain)
            r.setdefault("mtp depth-1 cycle ms", []).append(mtp)
            r.setdefault("cycle / plain step", []).append(mtp / plain)
    print(f"load after: {os.getloadavg()}")
    products = products_ms(models["native"])
    print(f"quantized products of one token alone (one thread): {products:.2f} ms CPU")
    print("| figure | native (quantized) | f32 | native / f32 |")
    print("|---|---|---|---|")
    for name in rows["native"]:
        a, b = statistics.median(rows["native"][name]), statistics.median(rows["f32"][name])
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
