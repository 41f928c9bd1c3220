"""Paired A/B of the engine against the engine's modules as they were at a git revision.

Both engines run in this one process on the same loaded model (``mtplx/engine.py``, its
phase modules and the per-row state and cycle modules they share -- ``sequence``, ``cycle``,
``speculative``, ``step`` -- at ``--rev``; the rest of the package, drafters included, is
the working tree's: to compare those too, run each tree in a process of its own), so
outputs can be compared token for token and speed measured in CPU time, turn about, which a
loaded shared machine does not skew the way wall time is skewed:

    python scripts/engine_ab.py --rev HEAD~1 [--model DIR] [--tokens 48] [--rounds 3]

Outputs: greedy and seeded fixed-depth generations for every drafter the model offers,
alone and 16 at once, must be identical (exit 1 otherwise). Speed: CPU seconds per token of
greedy generations with the default drafter (adaptive depth), 1 and 16 streams at once
(``--streams``), best of ``--rounds`` per side; the ratio is old / new (above 1: the
working tree is faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


PROMPTS = [
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
    "List the planets of the solar system in order:",
]


# The engine's modules (``mtplx.engine`` assembles the phase classes of the others) and the
# sequence and cycle modules they pass between them, in an order where each comes after
# those it imports.
ENGINE_MODULES = (
    "cycle",
    "sequence",
    "speculative",
    "step",
    "engine_state",
    "prefill",
    "admission",
    "schedule",
    "runner",
    "postprocess",
)


def old_engine_module(rev: str) -> ModuleType:
    """``mtplx/engine.py`` at ``rev`` with the engine's phase modules of that revision (those
    it has), imported as modules of their own beside the new ones."""
    renamed = {}
    for name in (*ENGINE_MODULES, "engine"):
        path = f"{rev}:mtplx/{name}.py"
        shown = subprocess.run(["git", "show", path], cwd=ROOT, capture_output=True)
        if shown.returncode:
            continue  # not at that revision (before the engine was split)
        source = shown.stdout.decode()
        for old_name, alias in renamed.items():
            source = source.replace(f"from mtplx.{old_name} import", f"from {alias} import")
        alias = f"mtplx_before_{name}"
        spec = importlib.util.spec_from_loader(alias, loader=None)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[alias] = module
        exec(compile(source, path, "exec"), module.__dict__)
        renamed[name] = alias
    return sys.modules["mtplx_before_engine"]


def run_batch(engine: Any, requests: list[Any]) -> list[list[int]]:
    """Every request at once through the step loop; each one's token ids."""
    from mtplx.request import TokenEvent

    rows = {engine.add(request): index for index, request in enumerate(requests)}
    tokens: list[list[int]] = [[] for _ in requests]
    while engine.running:
        for sequence, event in engine.step():
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, TokenEvent):
                tokens[rows[sequence]].append(event.token_id)
    return tokens


def requests_for(tokenizer: Any, drafter: str, seeded: bool, count: int, num: int) -> list[Any]:
    from mtplx.request import GenerationRequest, SamplerConfig

    out = []
    for index in range(count):
        prompt = tokenizer.encode(PROMPTS[index % len(PROMPTS)])
        sampler = SamplerConfig(temperature=0.8, top_p=0.95, seed=index) if seeded else None
        out.append(
            GenerationRequest(
                prompt_ids=prompt,
                sampler=sampler or SamplerConfig(temperature=0.0),
                max_tokens=num,
                drafter=drafter,
                depth=None if drafter == "none" else 3,
                ignore_eos=True,
            )
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--model", help="checkpoint directory (default: the shipped model)")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--speed-only", action="store_true", help="skip the output comparison")
    parser.add_argument(
        "--streams", type=int, nargs="*", default=[1, 16], help="concurrent streams to time"
    )
    parser.add_argument("--drafters", nargs="*", help="compare these only (default: all)")
    args = parser.parse_args()

    from mtplx.engine import Engine as NewEngine
    from mtplx.models import load, make_layer_skip_draft
    from mtplx.models.gguf import ensure_default_model

    OldEngine = old_engine_module(args.rev).Engine
    model = load(args.model or ensure_default_model())
    draft = make_layer_skip_draft(model, 1)
    engines = {
        "old": OldEngine(model, draft_model=draft),
        "new": NewEngine(model, draft_model=draft),
    }
    tokenizer = model.tokenizer
    same = True
    drafters = args.drafters or engines["new"].available_drafters
    for drafter in () if args.speed_only else drafters:
        for seeded in (False, True):
            for count in (1, 16):
                reqs = requests_for(tokenizer, drafter, seeded, count, args.tokens)
                got = {side: run_batch(engine, reqs) for side, engine in engines.items()}
                equal = got["old"] == got["new"]
                same &= equal
                mode = "seeded" if seeded else "greedy"
                print(f"{drafter:18s} {mode:6s} x{count:<2d} identical={equal}", flush=True)

    default = engines["new"].default_drafter
    for streams in args.streams:
        best = {"old": float("inf"), "new": float("inf")}
        for round_ in range(args.rounds):
            # Turn about, each side first every other round: the one that runs second
            # inherits the first's allocator and cache state.
            for side in ("old", "new") if round_ % 2 == 0 else ("new", "old"):
                reqs = requests_for(tokenizer, default, False, streams, args.tokens * 2)
                started = time.process_time()
                tokens = run_batch(engines[side], reqs)
                spent = time.process_time() - started
                best[side] = min(best[side], spent / sum(len(t) for t in tokens))
        ratio = best["old"] / best["new"]
        print(
            f"{streams} stream(s), {default}: old {best['old'] * 1e3:.2f} ms CPU/token, "
            f"new {best['new'] * 1e3:.2f} ms CPU/token, speed new/old {ratio:.3f}",
            flush=True,
        )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
