"""Paired, in-process A/B of a depth-1 MTP cycle before and after this change, against a
plain step, on the default model.

One process, one loaded model, one engine (the process's ``MTPLX_ACTIVATIONS`` mode); turn
about, the order rotating every round:

- ``plain``: single-stream greedy plain decoding;
- ``mtp@1 before``: depth-1 MTP cycles with the drafter's feed (``propose_batch``, ``_feed``,
  ``_first``) and the fused head's layer (``_fused_rows``) switched back to their code at
  ``--before`` (read with ``git show``, loaded as modules of their own): every fed pair
  projected onto the draft vocabulary, gathers for the RoPE angles and the wanted pair;
- ``mtp@1 after``: the same cycles as the working tree runs them;
- ``verify only``: depth-1 cycles whose draft is a constant token drawn by the drafter's
  sampler from constant logits (no head step, no head bookkeeping): the trunk's verify of 2
  tokens and the cycle's own bookkeeping.

Per run: the median wall, process-CPU and engine-thread-CPU milliseconds of an engine step
(the first two after the prompt left out); then the medians over rounds, and ratios paired
per round, with the load average.

    python benchmarks/results/2026-12-03-mtp-cycle-2/cycle_ab.py [--rounds 8] [--before a9c68d5]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

# ruff: noqa: I001  (mtplx routes BLAS before MLX loads: it is imported first)
import mtplx  # noqa: E402,F401
import mlx.core as mx  # noqa: E402

from mtplx.drafters import mtp  # noqa: E402
from mtplx.engine import Engine  # noqa: E402
from mtplx.models import fused_head, load  # noqa: E402
from mtplx.models.gguf import ensure_default_model  # noqa: E402
from mtplx.models.quantized import activations_format  # noqa: E402
from mtplx.request import GenerationRequest  # noqa: E402
from mtplx.sampling import SamplerConfig  # noqa: E402

PROMPT = "Explain why the sky is blue in two sentences."
DRAFTER_METHODS = ("propose_batch", "_feed", "_first", "commit", "commit_lazy", "settle")


def _old_module(commit: str, path: str, name: str) -> ModuleType:
    """``path`` as it was at ``commit``, loaded as a module of its own."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:{path}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    target = Path(tempfile.mkdtemp()) / f"{name}.py"
    target.write_text(source)
    spec = importlib.util.spec_from_file_location(name, target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _constant_propose(self: Any, drafters: Any, histories: Any, ks: Any, samplers: Any) -> Any:
    out = []
    for k, sample in zip(ks, samplers, strict=True):
        size = sample.vocab_size if self.draft_vocab is None else int(self.draft_vocab.shape[0])
        logits = mx.zeros((size,), mx.float32)
        drafts: tuple[list, list] = ([], [])
        for _ in range(k):
            token, q = sample(logits)
            drafts[0].append(token)
            drafts[1].append(q)
        out.append(drafts)
    return out


class Switch:
    """The drafter's and the fused head's code: the working tree's, ``--before``'s, or no
    head at all (``verify only``)."""

    def __init__(self, before: str) -> None:
        self.after = {m: getattr(mtp.MTPDrafter, m) for m in DRAFTER_METHODS}
        self.after_rows = fused_head._fused_rows
        old_mtp = _old_module(before, "mtplx/drafters/mtp.py", "mtp_before")
        old_head = _old_module(before, "mtplx/models/fused_head.py", "fused_head_before")
        self.before = {m: getattr(old_mtp.MTPDrafter, m) for m in DRAFTER_METHODS}
        self.before_rows = old_head._fused_rows

    def set(self, kind: str) -> None:
        methods, rows = self.after, self.after_rows
        if kind == "before":
            methods, rows = self.before, self.before_rows
        for name, method in methods.items():
            setattr(mtp.MTPDrafter, name, method)
        fused_head._fused_rows = rows
        if kind == "verify only":
            mtp.MTPDrafter.propose_batch = _constant_propose
            for name in ("commit", "commit_lazy", "settle"):
                setattr(mtp.MTPDrafter, name, lambda self, *a: None)


def _add(engine: Engine, drafter: str, depth: int, tokens: int) -> None:
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


def _run(engine: Engine, drafter: str, depth: int, tokens: int) -> tuple[float, ...]:
    _add(engine, drafter, depth, tokens)
    engine.step()  # the prompt
    wall, proc, thread = [], [], []
    while engine.running:
        w, p, t = time.perf_counter(), time.process_time(), time.thread_time()
        engine.step()
        wall.append(time.perf_counter() - w)
        proc.append(time.process_time() - p)
        thread.append(time.thread_time() - t)
    return tuple(1e3 * statistics.median(x[2:]) for x in (wall, proc, thread))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--before", default="a9c68d5")
    args = parser.parse_args()
    switch = Switch(args.before)
    engine = Engine(load(ensure_default_model("native")))
    engine.warm_up()
    print(f"activations: {activations_format()}; load before: {os.getloadavg()}")
    kinds = [
        ("plain", "none", 0, "after"),
        ("mtp@1 before", "mtp", 1, "before"),
        ("mtp@1 after", "mtp", 1, "after"),
        ("verify only", "mtp", 1, "verify only"),
    ]
    results: dict[str, list[tuple[float, ...]]] = {k[0]: [] for k in kinds}
    for r in range(args.rounds):
        for name, drafter, depth, code in kinds[r % 4 :] + kinds[: r % 4]:
            switch.set(code)
            try:
                results[name].append(_run(engine, drafter, depth, args.tokens))
            finally:
                switch.set("after")
    print(f"load after: {os.getloadavg()}")
    print("| per step, median over rounds | wall ms | process CPU ms | engine thread CPU ms |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        cells = " | ".join(f"{statistics.median(r[i] for r in runs):.2f}" for i in range(3))
        print(f"| {name} | {cells} |")
    print("| paired per round (medians) | wall | process CPU | engine thread CPU |")
    print("|---|---|---|---|")
    for name in ("mtp@1 before", "mtp@1 after", "verify only"):
        pairs = list(zip(results[name], results["plain"], strict=True))
        cells = " | ".join(
            f"{statistics.median(m[i] / p[i] for m, p in pairs):.3f}" for i in range(3)
        )
        extra = statistics.median(m[1] - p[1] for m, p in pairs)
        print(f"| {name} / plain | {cells} | (CPU extra {extra:+.2f} ms) |")
    pairs = list(zip(results["mtp@1 after"], results["mtp@1 before"], strict=True))
    cells = " | ".join(f"{statistics.median(a[i] / b[i] for a, b in pairs):.3f}" for i in range(3))
    print(f"| mtp@1 after / before | {cells} |")


if __name__ == "__main__":
    main()
