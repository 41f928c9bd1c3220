"""Paired, in-process A/B of the sampled path's kernel nodes against MLX's ops (the
``sampling._KERNEL_ON`` switch, what ``MTPLX_SAMPLED_KERNEL=0`` sets): one engine on the
default model, one seeded request at a time at T, turn about with the order alternating;
per request the wall and process CPU per generated token (the whole request: prompt
excluded by a warm first step), medians and paired ratios; the tokens must be the same
both ways (the kernel's bits are MLX's).

    python kernel_switch_ab.py [rounds] [tokens] [temperature] [drafter] [depth] [threads]

threads: the quantized products' and attention's threads (default: the process's); 1 takes
the helper threads' spinning out of the process CPU, leaving the work itself.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import mtplx  # noqa: F401
from mtplx import attention, fused_layer, quant, sampling
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest, TokenEvent
from mtplx.sampling import SamplerConfig

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 10
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 64
TEMPERATURE = float(sys.argv[3]) if len(sys.argv) > 3 else 0.6
DRAFTER = sys.argv[4] if len(sys.argv) > 4 else "none"
DEPTH = int(sys.argv[5]) if len(sys.argv) > 5 else 0
THREADS = int(sys.argv[6]) if len(sys.argv) > 6 else 0


def run(engine: Engine, seed: int) -> tuple[float, float, list[int]]:
    """One request: (wall ms, process CPU ms) per token after the first, and its tokens."""
    request = GenerationRequest(
        prompt_ids=[1, 2, 3, 4, 5, 6, 7, 8],
        sampler=SamplerConfig(temperature=TEMPERATURE, seed=seed),
        max_tokens=TOKENS,
        ignore_eos=True,
        drafter=DRAFTER,
        depth=DEPTH,
    )
    tokens: list[int] = []
    events = engine.generate(request)
    for event in events:  # the prompt and the first token
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
            break
    w, c = time.perf_counter(), time.process_time()
    for event in events:
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
    wall, cpu = time.perf_counter() - w, time.process_time() - c
    return 1e3 * wall / (len(tokens) - 1), 1e3 * cpu / (len(tokens) - 1), tokens


def main() -> None:
    engine = Engine(load(ensure_default_model("native")))
    engine.warm_up()
    if THREADS:
        quant.set_threads(THREADS)
        attention.set_threads(THREADS)
    print(
        f"T={TEMPERATURE} drafter={DRAFTER} depth={DEPTH} tokens={TOKENS} rounds={ROUNDS} "
        f"threads={THREADS or 'default'}"
    )
    print(f"load before: {os.getloadavg()}")
    results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    copies = {True: 0, False: 0}  # KV stores a layer node copied instead of writing in place
    for r in range(ROUNDS):
        outputs = {}
        for on in (True, False) if r % 2 == 0 else (False, True):
            sampling._KERNEL_ON = on
            before = fused_layer.store_copies()
            wall, cpu, tokens = run(engine, seed=r)
            copies[on] += fused_layer.store_copies() - before
            results[on].append((wall, cpu))
            outputs[on] = tokens
        sampling._KERNEL_ON = True
        assert outputs[True] == outputs[False], f"round {r}: the tokens differ"
        print(
            f"round {r}: kernel {results[True][-1][0]:.2f} / {results[True][-1][1]:.2f}, "
            f"MLX ops {results[False][-1][0]:.2f} / {results[False][-1][1]:.2f} ms a token "
            f"(wall / CPU); load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    print(f"load after: {os.getloadavg()}")
    for on, name in ((True, "kernel"), (False, "MLX ops")):
        wall = statistics.median(x[0] for x in results[on])
        cpu = statistics.median(x[1] for x in results[on])
        print(f"{name}: median wall {wall:.3f} ms/token, process CPU {cpu:.3f} ms/token")
    pairs = list(zip(results[True], results[False], strict=True))
    for i, what in ((0, "wall"), (1, "process CPU")):
        ratio = statistics.median(a[i] / b[i] for a, b in pairs)
        extra = statistics.median(a[i] - b[i] for a, b in pairs)
        print(f"kernel / MLX ops, {what}: {ratio:.3f} (paired median, {extra:+.3f} ms/token)")
    print("tokens identical both ways in every round")
    print(f"KV store copies: kernel {copies[True]}, MLX ops {copies[False]}")


if __name__ == "__main__":
    main()
