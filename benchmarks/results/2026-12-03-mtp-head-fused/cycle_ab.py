"""Paired, in-process A/B of a depth-1 MTP cycle against a plain step on the default model.

One process, one loaded model, one engine; turn about (the order rotating every round):

- ``plain``: single-stream greedy plain decoding;
- ``mtp@1 before``: depth-1 MTP cycles with the head as it ran before (mlx-lm's llama layer,
  ``NextNHead.fuses_layer = False``; uniforms drawn for greedy cycles too; the draft
  vocabulary copied to the host every cycle);
- ``mtp@1 after``: the same cycles on the fused head as the working tree runs them.

Per run: the median and the 20th percentile of the wall milliseconds of an engine step (the
first two steps after the prompt left out; on a loaded machine the low percentile is the
steps that had the cores), and the process's and the engine thread's CPU milliseconds per
step (medians). Prints the medians over rounds and the paired cycle / plain ratios, with
the load average.

    python benchmarks/results/2026-12-03-mtp-head-fused/cycle_ab.py [--rounds 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

# ruff: noqa: I001  (mtplx routes BLAS before MLX loads: it is imported first)
import mtplx  # noqa: E402,F401
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mtplx import speculative  # noqa: E402
from mtplx.drafters import base as drafter_base  # noqa: E402
from mtplx.engine import Engine  # noqa: E402
from mtplx.models import load  # noqa: E402
from mtplx.models.gguf import ensure_default_model  # noqa: E402
from mtplx.request import GenerationRequest  # noqa: E402
from mtplx.sampling import SamplerConfig  # noqa: E402

PROMPT = "Explain why the sky is blue in two sentences."
NEW_UNIFORMS = speculative._next_uniforms
NEW_SAMPLER_INIT = drafter_base.DraftSampler.__init__


def _old_uniforms(sequence, num_draft):  # type: ignore[no-untyped-def]
    """The uniforms as drawn before: for every cycle, greedy ones included."""
    queued = sequence.queued
    if queued is None:
        return speculative.cycle_uniforms(sequence.seed, len(sequence.tokens), num_draft)
    candidates = np.stack(
        [
            speculative._uniforms(sequence.seed, len(sequence.tokens) + committed, num_draft)
            for committed in range(1, queued.draft.num_drafted + 2)
        ]
    )
    return mx.take(mx.array(candidates), queued.num_accepted, axis=0)[0]


def _old_sampler_init(
    self, config, vocab_size, uniforms, token_counts=None, draft_vocab=None, grammar=None
):  # type: ignore[no-untyped-def]
    NEW_SAMPLER_INIT(self, config, vocab_size, uniforms, token_counts, draft_vocab, grammar)
    self._draft_ids = None if draft_vocab is None else np.array(draft_vocab)


def _set(engine: Engine, before: bool) -> None:
    for head in engine.model.mtp_heads:
        head.fuses_layer = not before
    speculative._next_uniforms = _old_uniforms if before else NEW_UNIFORMS
    drafter_base.DraftSampler.__init__ = _old_sampler_init if before else NEW_SAMPLER_INIT


def _run(engine: Engine, drafter: str, depth: int, tokens: int) -> tuple[float, ...]:
    ids = list(
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True
        )
    )
    engine.add(
        GenerationRequest(
            prompt_ids=ids,
            sampler=SamplerConfig(temperature=0.0),
            max_tokens=tokens,
            ignore_eos=True,
            drafter=drafter,
            depth=depth,
        )
    )
    engine.step()  # the prompt
    wall, proc, thread = [], [], []
    while engine.running:
        w, p, t = time.perf_counter(), time.process_time(), time.thread_time()
        engine.step()
        wall.append(time.perf_counter() - w)
        proc.append(time.process_time() - p)
        thread.append(time.thread_time() - t)
    medians = [1e3 * statistics.median(x[2:]) for x in (wall, proc, thread)]
    return (*medians, 1e3 * statistics.quantiles(wall[2:], n=5)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    engine = Engine(load(ensure_default_model("native")))
    engine.warm_up()
    print(f"load before: {os.getloadavg()}")
    kinds = [("plain", "none", 0, False), ("before", "mtp", 1, True), ("after", "mtp", 1, False)]
    results: dict[str, list[tuple[float, ...]]] = {k[0]: [] for k in kinds}
    for r in range(args.rounds):
        for name, drafter, depth, before in kinds[r % 3 :] + kinds[: r % 3]:
            _set(engine, before)
            results[name].append(_run(engine, drafter, depth, args.tokens))
    _set(engine, False)
    print(f"load after: {os.getloadavg()}")
    print(
        "| per step (median over rounds) | wall ms | process CPU ms | engine thread CPU ms "
        "| wall ms, 20th percentile |"
    )
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        cells = " | ".join(f"{statistics.median(r[i] for r in runs):.2f}" for i in range(4))
        print(f"| {name} | {cells} |")
    for name in ("before", "after"):
        ratios = [m[0] / p[0] for m, p in zip(results[name], results["plain"], strict=True)]
        cpu = [m[1] / p[1] for m, p in zip(results[name], results["plain"], strict=True)]
        low = [m[3] / p[3] for m, p in zip(results[name], results["plain"], strict=True)]
        print(
            f"mtp@1 {name}: cycle / plain, paired per round (medians): wall "
            f"{statistics.median(ratios):.3f}, wall 20th percentile {statistics.median(low):.3f}, "
            f"process CPU {statistics.median(cpu):.3f}"
        )


if __name__ == "__main__":
    main()
