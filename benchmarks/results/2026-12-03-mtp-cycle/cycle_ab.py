"""Paired, in-process A/B of a depth-1 MTP cycle against a plain step on the default model.

One process, one loaded model, one engine (the process's ``MTPLX_ACTIVATIONS`` mode); turn
about, the order rotating every round:

- ``plain`` and ``plain before``: single-stream greedy plain decoding, as the working tree
  runs it and with its embedding lookup switched back (the one piece below a plain step
  has);
- ``before``: depth-1 MTP cycles with this change's pieces switched back to their previous
  code (copied below): the quantized embedding lookup in MLX's ops (``dequantize_rows``),
  the head's attention in mlx-lm's ops with its mask and RoPE angles computed every step,
  the greedy verdict and the drafter's bookkeeping as they were, and a queued cycle closed
  by reading a slice of its verdict (which waits for the cycle queued after it);
- ``after``: the same cycles as the working tree runs them.

Per run: the median wall, process-CPU and engine-thread-CPU milliseconds of an engine step
(the first two after the prompt left out) and the 20th percentile of the wall times; then
the medians over rounds and the cycle / plain ratios paired per round (``before`` against
``plain before``, ``after`` against ``plain``), with the load.

    python benchmarks/results/2026-12-03-mtp-cycle/cycle_ab.py [--rounds 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

# ruff: noqa: I001  (mtplx routes BLAS before MLX loads: it is imported first)
import mtplx  # noqa: E402,F401
import mlx.core as mx  # noqa: E402
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention  # noqa: E402

from mtplx import engine_state, quant, runner, speculative  # noqa: E402
from mtplx.arrays import int_list, scalar_int  # noqa: E402
from mtplx.cycle import CycleResult, QueuedDraft  # noqa: E402
from mtplx.drafters import mtp  # noqa: E402
from mtplx.engine import Engine  # noqa: E402
from mtplx.models import fused_head, load  # noqa: E402
from mtplx.models.gguf import ensure_default_model  # noqa: E402
from mtplx.models.quantized import InvariantQuantizedEmbedding, activations_format  # noqa: E402
from mtplx.request import GenerationRequest  # noqa: E402
from mtplx.sampling import SamplerConfig  # noqa: E402

PROMPT = "Explain why the sky is blue in two sentences."


# -- the previous code --------------------------------------------------------------------


def _old_embed(self: Any, x: mx.array) -> mx.array:
    return quant.dequantize_rows(
        x, self.weight, self.scales, self.biases, self.bits, self.group_size
    )


def _old_attend_row(
    attn: Any, cache: Any, q: mx.array, k: mx.array, v: mx.array, positions: mx.array
) -> mx.array:
    size = int(q.shape[0])
    q = q.reshape(1, size, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = k.reshape(1, size, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = v.reshape(1, size, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    mask = create_attention_mask(q.transpose(0, 2, 1, 3), cache)
    k, v = cache.update_and_fetch(k, v)
    out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(size, -1)


def _old_angles(self: Any, positions: mx.array, bound: int) -> tuple[mx.array, mx.array]:
    return self.tables(positions)  # type: ignore[no-any-return]


def _old_verify_greedy(
    target_logits: mx.array, draft_tokens: mx.array
) -> tuple[mx.array, mx.array]:
    batch, num_draft = draft_tokens.shape
    greedy = mx.argmax(target_logits, axis=-1).astype(mx.int32)
    matches = draft_tokens.astype(mx.int32) == greedy[:, :num_draft]
    num_accepted = mx.sum(mx.cumprod(matches.astype(mx.int32), axis=-1), axis=-1)
    if num_draft == 0:
        num_accepted = mx.zeros((batch,), mx.int32)
    token = mx.take_along_axis(greedy, num_accepted[:, None], axis=-1)
    positions = mx.arange(num_draft + 1)[None, :]
    padded = mx.concatenate([draft_tokens.astype(mx.int32), mx.zeros((batch, 1), mx.int32)], 1)
    boundary = num_accepted[:, None]
    output = mx.where(positions < boundary, padded, mx.where(positions == boundary, token, -1))
    return num_accepted.astype(mx.int32), output


def _old_queue_draft(target, sequence, draft, output, source, started, verdict=None):  # type: ignore[no-untyped-def]
    num_accepted, output_tokens = verdict or speculative.verify(sequence, draft, output)
    target.trim_lazily(sequence.row, draft.num_drafted - num_accepted[0])
    sequence.drafter.commit_lazy(output_tokens[0], output.hidden[None], num_accepted[0] + 1)
    unread = mx.zeros((), mx.int32)  # nothing read it before: the trim was not evaluated with it
    return QueuedDraft(draft, output, num_accepted, output_tokens, source, started, unread)


def _old_close_queued(target, sequence, queued):  # type: ignore[no-untyped-def]
    num_accepted = scalar_int(queued.num_accepted)
    committed = int_list(queued.output_tokens[0, : num_accepted + 1])
    verify_time = time.perf_counter() - queued.started
    num_rejected = target.settle(sequence.row)
    sequence.drafter.settle(num_rejected)
    return CycleResult(
        committed,
        queued.draft.num_drafted,
        num_accepted,
        queued.output.asked_logits()[: len(committed)],
        queued.draft.draft_time,
        verify_time,
    )


def _old_last_committed(sequence, queued):  # type: ignore[no-untyped-def]
    if queued is None:
        return mx.array([sequence.tokens[-1]], mx.int32)
    return mx.take(queued.output_tokens[0], queued.num_accepted)


def _old_first(self, out_logits, out_hidden, tokens_in, valid):  # type: ignore[no-untyped-def]
    if valid is None:
        logits, hidden = out_logits[0, -1], out_hidden[:, -1:]
    else:
        unused = self._last_size - valid
        self.cache[0].trim_lazily(unused)
        self.num_fed_unsettled += 1
        last = (tokens_in.shape[1] - 1 - unused).reshape(1)
        logits = mx.take(out_logits[0], last, axis=0)[0]
        hidden = mx.take(out_hidden, last, axis=1)
    self.checkpoint = self.cache[0].checkpoint()
    return logits, hidden


NEW = {
    (InvariantQuantizedEmbedding, "__call__"): InvariantQuantizedEmbedding.__call__,
    (fused_head, "_attend_row"): fused_head._attend_row,
    (fused_head.RopeAngles, "at"): fused_head.RopeAngles.at,
    (speculative, "mx_verify_greedy"): speculative.mx_verify_greedy,
    (runner, "queue_draft"): runner.queue_draft,
    (engine_state, "close_queued"): engine_state.close_queued,
    (runner, "last_committed"): runner.last_committed,
    (mtp.MTPDrafter, "_first"): mtp.MTPDrafter._first,
}
OLD = dict(
    zip(
        NEW,
        [
            _old_embed,
            _old_attend_row,
            _old_angles,
            _old_verify_greedy,
            _old_queue_draft,
            _old_close_queued,
            _old_last_committed,
            _old_first,
        ],
        strict=True,
    )
)


def _set(before: bool) -> None:
    for (owner, name), fn in (OLD if before else NEW).items():
        setattr(owner, name, fn)


# -- the runs -----------------------------------------------------------------------------


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
    print(f"activations: {activations_format()}; load before: {os.getloadavg()}")
    kinds = [
        ("plain before", "none", 0, True),
        ("plain", "none", 0, False),
        ("before", "mtp", 1, True),
        ("after", "mtp", 1, False),
    ]
    results: dict[str, list[tuple[float, ...]]] = {k[0]: [] for k in kinds}
    for r in range(args.rounds):
        for name, drafter, depth, before in kinds[r % 4 :] + kinds[: r % 4]:
            _set(before)
            results[name].append(_run(engine, drafter, depth, args.tokens))
    _set(False)
    print(f"load after: {os.getloadavg()}")
    print(
        "| per step (median over rounds) | wall ms | process CPU ms | engine thread CPU ms "
        "| wall ms, 20th percentile |"
    )
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        cells = " | ".join(f"{statistics.median(r[i] for r in runs):.2f}" for i in range(4))
        print(f"| {name} | {cells} |")
    for name, plain in (("before", "plain before"), ("after", "plain")):
        pairs = list(zip(results[name], results[plain], strict=True))
        print(
            f"mtp@1 {name}: cycle / plain, paired per round (medians): wall "
            f"{statistics.median(m[0] / p[0] for m, p in pairs):.3f}, wall 20th percentile "
            f"{statistics.median(m[3] / p[3] for m, p in pairs):.3f}, process CPU "
            f"{statistics.median(m[1] / p[1] for m, p in pairs):.3f}"
        )


if __name__ == "__main__":
    main()
