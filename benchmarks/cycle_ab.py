"""Paired, in-process A/B of a depth-1 MTP cycle against a plain step, with chosen pieces of
the code switched back to a git revision's: the harness the MTP-cycle passes share.

One process, one loaded model (the default one), one engine, the process's
``MTPLX_ACTIVATIONS`` mode; turn about, the order rotating every round, greedy, one stream:

- ``plain``: plain decoding;
- ``mtp@1 before``: depth-1 MTP cycles with every ``--switch`` attribute taken from
  ``--before`` (the file read with ``git show``, loaded as a module of its own, so its
  imports are the working tree's modules);
- ``mtp@1 after``: the same cycles as the working tree runs them;
- ``verify only``: depth-1 cycles whose draft is a constant token drawn by the drafter's
  sampler from constant logits (no head step, no head bookkeeping): the trunk's verify of 2
  tokens and the cycle's own bookkeeping;
- ``plain before``, ``verify only before``: those two with the ``--switch`` attributes taken
  from ``--before``.

A switch is ``path:attribute`` or ``path:Class.method``: ``mtplx/speculative.py:verify``
replaces ``mtplx.speculative.verify`` (callers that look it up in that module get the old
one). A name another module imported (``from ... import``) is switched there with
``place=source``: ``mtplx/runner.py:queue_draft=mtplx/speculative.py:queue_draft`` sets
``mtplx.runner.queue_draft`` to ``--before``'s ``mtplx.speculative.queue_draft``. Without a
``--switch``, ``before`` and ``after`` are the same code (an A/A run: the spread of the
method).

Per run: the median wall, process-CPU and engine-thread-CPU milliseconds of an engine step
(the first two after the prompt left out; the engine steps on this thread); then the medians
over rounds and the ratios paired per round, with the load averages before and after.

    python benchmarks/cycle_ab.py --rounds 12 --before HEAD \\
        --switch mtplx/speculative.py:verify
"""

from __future__ import annotations

import argparse
import importlib
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# ruff: noqa: I001  (mtplx routes BLAS before MLX loads: it is imported first)
import mtplx  # noqa: E402,F401
import mlx.core as mx  # noqa: E402

from mtplx.drafters import mtp  # noqa: E402
from mtplx.engine import Engine  # noqa: E402
from mtplx.models import load  # noqa: E402
from mtplx.models.gguf import ensure_default_model  # noqa: E402
from mtplx.models.quantized import activations_format  # noqa: E402
from mtplx.request import GenerationRequest  # noqa: E402
from mtplx.request import SamplerConfig  # noqa: E402

PROMPT = "Explain why the sky is blue in two sentences."
KINDS = ("plain", "mtp@1 before", "mtp@1 after", "verify only")
# Also accepted by --kinds: the plain and verify-only steps with the switches from --before.
MORE_KINDS = ("plain before", "verify only before")


def old_module(commit: str, path: str) -> ModuleType:
    """``path`` as it was at ``commit``, loaded as a module of its own (its imports are the
    working tree's modules)."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:{path}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    name = "before_" + path.removesuffix(".py").replace("/", "_")
    target = Path(tempfile.mkdtemp()) / f"{name}.py"
    target.write_text(source)
    spec = importlib.util.spec_from_file_location(name, target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def _constant_propose(self: Any, drafters: Any, histories: Any, ks: Any, samplers: Any) -> Any:
    """``propose_batch`` without a head step: each draft drawn from constant logits."""
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
    """The switched attributes as the working tree has them, ``before``'s, or the head
    knocked out (``verify only``)."""

    def __init__(self, before: str, specs: list[str]) -> None:
        self.places: list[tuple[Any, str, Any, Any]] = []  # (owner, name, after, before)
        olds: dict[str, ModuleType] = {}
        for spec in specs:
            place, _, source = spec.partition("=")
            path, attribute = place.split(":")
            old_path, old_attribute = (source or place).split(":")
            if old_path not in olds:
                olds[old_path] = old_module(before, old_path)
            owner = importlib.import_module(path.removesuffix(".py").replace("/", "."))
            *owners, name = attribute.split(".")
            for part in owners:
                owner = getattr(owner, part)
            old_owner: Any = olds[old_path]
            *old_owners, old_name = old_attribute.split(".")
            for part in old_owners:
                old_owner = getattr(old_owner, part)
            self.places.append((owner, name, owner.__dict__[name], old_owner.__dict__[old_name]))
        self.drafter = {n: mtp.MTPDrafter.__dict__[n] for n in ("propose_batch", "commit_lazy")}
        self.drafter.update({n: mtp.MTPDrafter.__dict__[n] for n in ("commit", "settle")})

    def set(self, code: str) -> None:
        """``after``, ``before``, ``verify only`` or ``verify only before``."""
        for owner, name, after, before in self.places:
            setattr(owner, name, before if code.endswith("before") else after)
        for name, method in self.drafter.items():
            setattr(mtp.MTPDrafter, name, method)
        if code.startswith("verify only"):
            mtp.MTPDrafter.propose_batch = _constant_propose  # type: ignore[method-assign]
            for name in ("commit", "commit_lazy", "settle"):
                setattr(mtp.MTPDrafter, name, lambda self, *a: None)


FILTERS: dict[str, float] = {}  # --top-k / --top-p of a sampled request


def add(engine: Engine, drafter: str, depth: int, tokens: int, temperature: float) -> None:
    """Queue the benchmark's request (``drafter`` at ``depth``; ``none``, 0: plain), greedy
    at ``temperature`` 0, else sampled with a fixed seed (and ``FILTERS``)."""
    ids = list(
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True
        )
    )
    engine.add(
        GenerationRequest(
            prompt_ids=ids,
            sampler=SamplerConfig(
                temperature=temperature,
                seed=0 if temperature else None,
                top_k=int(FILTERS.get("top_k", 0)) if temperature else 0,
                top_p=FILTERS.get("top_p", 1.0) if temperature else 1.0,
            ),
            max_tokens=tokens,
            ignore_eos=True,
            drafter=drafter,
            depth=depth,
        )
    )


def run(
    engine: Engine, drafter: str, depth: int, tokens: int, temperature: float
) -> tuple[float, float, float]:
    """One request to its end: the median wall, process-CPU and this thread's CPU ms of a
    step (the prompt's step and the first two after it left out)."""
    add(engine, drafter, depth, tokens, temperature)
    engine.step()  # the prompt
    wall, proc, thread = [], [], []
    while engine.running:
        w, p, t = time.perf_counter(), time.process_time(), time.thread_time()
        engine.step()
        wall.append(time.perf_counter() - w)
        proc.append(time.process_time() - p)
        thread.append(time.thread_time() - t)
    w_ms, p_ms, t_ms = (1e3 * statistics.median(x[2:]) for x in (wall, proc, thread))
    return w_ms, p_ms, t_ms


def report(results: dict[str, list[tuple[float, float, float]]]) -> None:
    """The medians over rounds and the ratios paired per round."""
    print("| per step, median over rounds | wall ms | process CPU ms | engine thread CPU ms |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        cells = " | ".join(f"{statistics.median(r[i] for r in runs):.2f}" for i in range(3))
        print(f"| {name} | {cells} |")
    print()
    print("| paired per round (medians) | wall | process CPU | engine thread CPU |")
    print("|---|---|---|---|")
    pairs_of = [(n, "plain") for n in ("mtp@1 before", "mtp@1 after", "verify only")]
    pairs_of.append(("mtp@1 after", "mtp@1 before"))
    pairs_of += [("mtp@1 before", "plain before"), ("verify only before", "plain before")]
    pairs_of += [("plain", "plain before"), ("verify only", "verify only before")]
    for a, b in pairs_of:
        if a not in results or b not in results:
            continue
        pairs = list(zip(results[a], results[b], strict=True))
        cells = " | ".join(
            f"{statistics.median(x[i] / y[i] for x, y in pairs):.3f}" for i in range(3)
        )
        extra = [statistics.median(x[i] - y[i] for x, y in pairs) for i in range(3)]
        print(
            f"| {a} / {b} | {cells} | (wall {extra[0]:+.3f}, CPU {extra[1]:+.3f}, "
            f"thread {extra[2]:+.3f} ms) |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="with --temperature (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature")
    parser.add_argument("--before", default="HEAD")
    parser.add_argument(
        "--switch", action="append", default=[], help="path:attribute[=path:attribute]"
    )
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help="a comma list of " + str(KINDS + MORE_KINDS)
    )
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    FILTERS.update(top_k=args.top_k, top_p=args.top_p)
    switch = Switch(args.before, args.switch)
    engine = Engine(load(ensure_default_model("native")))
    engine.warm_up()
    spec = {"plain": ("none", 0, "after"), "mtp@1 before": ("mtp", 1, "before")}
    spec.update({"mtp@1 after": ("mtp", 1, "after"), "verify only": ("mtp", 1, "verify only")})
    spec.update({"plain before": ("none", 0, "before")})
    spec.update({"verify only before": ("mtp", 1, "verify only before")})
    print(
        f"activations: {activations_format()}; before: {args.before}; switch: {args.switch}; "
        f"temperature: {args.temperature}; top_k {args.top_k}, top_p {args.top_p}"
    )
    print(f"load before: {os.getloadavg()}")
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for name in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            drafter, depth, code = spec[name]
            switch.set(code)
            try:
                results[name].append(run(engine, drafter, depth, args.tokens, args.temperature))
            finally:
                switch.set("after")
    print(f"load after: {os.getloadavg()}")
    report(results)


if __name__ == "__main__":
    main()
