"""Paired, in-process A/B of a depth-1 MTP cycle before and after this change, against a
plain step, on the default model (the previous pass's script, its switch extended to this
pass's changes).

One process, one loaded model, one engine (the process's ``MTPLX_ACTIVATIONS`` mode); turn
about, the order rotating every round:

- ``plain``: single-stream greedy plain decoding;
- ``mtp@1 before``: depth-1 MTP cycles with the drafter's feed (``propose_batch``, ``_feed``,
  ``_first``), the fused head's layer (``_fused_rows``) and its compiled ends (``into``,
  ``out``, ``out_at``), the verify's greedy verdict and the trunk's layout of a lazily
  trimmed row (``build_group``, its RoPE positions) switched back to their code at
  ``--before`` (read with ``git show``, loaded as modules of their own);
- ``mtp@1 after``: the same cycles as the working tree runs them;
- ``verify only``: depth-1 cycles whose draft is a constant token drawn by the drafter's
  sampler from constant logits (no head step, no head bookkeeping): the trunk's verify of 2
  tokens and the cycle's own bookkeeping.

Per run: the median wall, process-CPU and engine-thread-CPU milliseconds of an engine step
(the first two after the prompt left out); then the medians over rounds, and ratios paired
per round, with the load average.

    python benchmarks/results/2026-12-03-mtp-cycle-3/cycle_ab.py [--rounds 12] [--before 38327e3]
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

from mtplx import speculative  # noqa: E402
from mtplx.drafters import mtp  # noqa: E402
from mtplx.engine import Engine  # noqa: E402
from mtplx.models import fused_head, load, slot_target  # noqa: E402
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
    sys.modules[name] = module  # dataclasses look their module up while it loads
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


# Module-level functions switched too: the verdict's and the trunk's layout of a lazily
# trimmed row.
FUNCTIONS = (
    (speculative, "_verify_argmax_rows"),
    (speculative, "mx_verify_greedy"),
    (slot_target, "build_group"),
    (slot_target, "shifted_positions"),
)


class Switch:
    """The drafter's, the fused head's and the verdict's code: the working tree's,
    ``--before``'s, or no head at all (``verify only``)."""

    def __init__(self, before: str) -> None:
        self.after = {m: getattr(mtp.MTPDrafter, m) for m in DRAFTER_METHODS}
        self.after_rows = fused_head._fused_rows
        self.after_functions = [getattr(module, name) for module, name in FUNCTIONS]
        self.old_mtp = _old_module(before, "mtplx/drafters/mtp.py", "mtp_before")
        self.old_head = _old_module(before, "mtplx/models/fused_head.py", "fused_head_before")
        old_sampling = _old_module(before, "mtplx/sampling.py", "sampling_before")
        old_speculative = _old_module(before, "mtplx/speculative.py", "speculative_before")
        old_layout = _old_module(before, "mtplx/models/slot_layout.py", "slot_layout_before")

        def old_positions(rows: Any, counts: Any) -> Any:  # the forward's code before
            positions = old_layout.packed_positions(rows, counts)
            shifts = old_layout.token_shifts(rows, counts)
            return positions if shifts is None else positions - shifts

        self.before = {m: getattr(self.old_mtp.MTPDrafter, m) for m in DRAFTER_METHODS}
        self.before_rows = self.old_head._fused_rows
        self.before_functions = [
            old_speculative._verify_argmax_rows,
            old_sampling.mx_verify_greedy,
            old_layout.build_group,
            old_positions,
        ]
        self.parts: dict[Any, tuple[Any, Any]] = {}  # head -> (after's parts, before's)

    def _parts(self, head: Any) -> tuple[Any, Any]:
        """The head's fused parts as the working tree builds them, and with ``--before``'s
        compiled ends (``into``, ``out``, ``out_at``)."""
        if head not in self.parts:
            fused_head.fuse_head(head)
            after = head.fused
            ends = self.old_head._compiled_ends(head.module, head.trunk)
            self.parts[head] = (after, after._replace(into=ends[0], out=ends[1], out_at=ends[2]))
        return self.parts[head]

    def set(self, kind: str, heads: list[Any]) -> None:
        methods, rows, functions = self.after, self.after_rows, self.after_functions
        if kind == "before":
            methods, rows, functions = self.before, self.before_rows, self.before_functions
        for name, method in methods.items():
            setattr(mtp.MTPDrafter, name, method)
        fused_head._fused_rows = rows
        for (module, name), function in zip(FUNCTIONS, functions, strict=True):
            setattr(module, name, function)
        for head in heads:
            head.fused = self._parts(head)[1 if kind == "before" else 0]
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
    parser.add_argument("--before", default="38327e3")
    args = parser.parse_args()
    switch = Switch(args.before)
    engine = Engine(load(ensure_default_model("native")))
    heads = list(engine.model.mtp_heads[:1])
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
            switch.set(code, heads)
            try:
                results[name].append(_run(engine, drafter, depth, args.tokens))
            finally:
                switch.set("after", heads)
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
