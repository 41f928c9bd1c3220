"""The optimisation loop: windows of (h[i], x[i+1]) pairs against the teacher's distribution
at position i+1 (top-k probabilities restricted to the draft vocabulary), AdamW with linear
warmup and cosine decay, gradient clipping; seeded batch order.

Loss per position: ``-sum_k p_k log q(id_k)`` over the teacher's top-k ids that lie in the
draft vocabulary (soft cross-entropy, i.e. KL to the teacher up to a constant; the mass the
draft vocabulary cannot express is simply not asked for). Reported alongside: top-1 agreement
of the head's argmax with the teacher's argmax (what greedy position-1 acceptance measures).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, field

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from mtplx.models.mtp_nextn import NextNModule
from mtplx.models.target import Trunk
from mtplx.train.data import Sequences, Teacher
from mtplx.train.depth2 import depth2_forward
from mtplx.train.head import head_forward

logger = logging.getLogger(__name__)


@dataclass
class Windows:
    """Training windows of length ``seq_len`` (pairs), as index arrays into the token stream:
    input pair j of window w is (hidden[start+j], token[start+j+1]), target teacher[start+j+1].
    ``length[w]`` is the number of real pairs (the rest is padding)."""

    start: np.ndarray  # int64 [W]
    length: np.ndarray  # int64 [W]

    @classmethod
    def cut(cls, seqs: Sequences, seq_len: int) -> Windows:
        starts, lengths = [], []
        for j in range(len(seqs)):
            a, b = int(seqs.offsets[j]), int(seqs.offsets[j + 1])
            for s in range(a, b - 1, seq_len):
                starts.append(s)
                lengths.append(min(seq_len, b - 1 - s))
        return cls(np.asarray(starts, np.int64), np.asarray(lengths, np.int64))


@dataclass
class Batch:
    hidden: mx.array  # float32 [B, T, H]
    tokens: mx.array  # int32 [B, T]
    target_ids: mx.array  # int32 [B, T, K] (draft-vocab ids; invalid -> 0)
    target_probs: mx.array  # float32 [B, T, K] (0 where invalid or padding)
    teacher_best: mx.array  # int32 [B, T] teacher argmax in draft ids (-1: not in V')
    mask: mx.array  # float32 [B, T]


def make_batch(
    windows: Windows,
    chosen: np.ndarray,
    seqs: Sequences,
    teacher: Teacher,
    to_draft: np.ndarray,
    seq_len: int,
) -> Batch:
    """Gather the windows ``chosen`` into padded arrays."""
    b, k = len(chosen), teacher.top_ids.shape[1]
    rel = np.arange(seq_len)
    idx = windows.start[chosen][:, None] + rel[None, :]
    valid = rel[None, :] < windows.length[chosen][:, None]
    idx = np.where(valid, idx, windows.start[chosen][:, None])
    nxt = idx + 1
    hidden = teacher.hidden[idx].astype(np.float32)
    tokens = seqs.tokens[nxt]
    ids = to_draft[teacher.top_ids[nxt]]
    probs = teacher.top_probs[nxt].astype(np.float32) * (ids >= 0) * valid[..., None]
    best = ids[np.arange(b)[:, None], rel[None, :], teacher.top_probs[nxt].argmax(-1)]
    return Batch(
        mx.array(hidden),
        mx.array(tokens.astype(np.int32)),
        mx.array(np.maximum(ids, 0).reshape(b, seq_len, k).astype(np.int32)),
        mx.array(probs),
        mx.array(np.where(valid, best, -1).astype(np.int32)),
        mx.array(valid.astype(np.float32)),
    )


def _soft_ce(
    logits: mx.array, ids: mx.array, probs: mx.array, best: mx.array, mask: mx.array
) -> tuple[mx.array, mx.array]:
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logp, ids, axis=-1)
    per_pos = -(picked * probs).sum(-1)
    agree = ((mx.argmax(logits, axis=-1) == best) * mask).sum()
    return per_pos.sum() / mx.maximum(mask.sum(), 1.0), agree


def loss_fn(
    module: NextNModule, trunk: Trunk, batch: Batch, depth2_weight: float = 0.0
) -> tuple[mx.array, mx.array]:
    """(mean soft cross-entropy over real positions, top-1 agreement count at depth 1).
    With ``depth2_weight`` > 0, adds that share of the depth-2 loss: the head fed its own
    (stop-gradient) output out1[i] and the true x[i+2], against the teacher at i+2."""
    logits, out, layer_in = head_forward(module, trunk, batch.hidden, batch.tokens)
    loss, agree = _soft_ce(
        logits, batch.target_ids, batch.target_probs, batch.teacher_best, batch.mask
    )
    if depth2_weight > 0:
        logits2 = depth2_forward(
            module, trunk, layer_in, mx.stop_gradient(out[:, :-1]), batch.tokens[:, 1:]
        )
        loss2, _ = _soft_ce(
            logits2,
            batch.target_ids[:, 1:],
            batch.target_probs[:, 1:],
            batch.teacher_best[:, 1:],
            batch.mask[:, 1:],
        )
        loss = loss + depth2_weight * loss2
    return loss, agree


def initial_behaviour(
    module: NextNModule,
    trunk: Trunk,
    seqs: Sequences,
    teacher: Teacher,
    draft_vocab: np.ndarray,
    seq_len: int,
    count: int = 8,
) -> dict[str, float]:
    """Before training: how often the head's argmax is x[i+1] (the token it is given, i.e.
    the target's *next* token) versus the teacher's argmax for x[i+2], on ``count`` windows."""
    to_draft = _draft_index(trunk, teacher, draft_vocab)
    windows = Windows.cut(seqs, seq_len)
    chosen = np.arange(min(count, len(windows.start)))
    batch = make_batch(windows, chosen, seqs, teacher, to_draft, seq_len)
    logits, _, _ = head_forward(module, trunk, batch.hidden, batch.tokens)
    guess = mx.array(draft_vocab)[mx.argmax(logits, axis=-1)]
    n = float(batch.mask.sum().item())
    copies = float(((guess == batch.tokens) * batch.mask).sum().item()) / n
    best = mx.array(draft_vocab)[mx.maximum(batch.teacher_best, 0)]
    right = (guess == best) * (batch.teacher_best >= 0) * batch.mask
    return {"predicts_given_token": copies, "agrees_with_teacher": float(right.sum().item()) / n}


def _draft_index(trunk: Trunk, teacher: Teacher, draft_vocab: np.ndarray) -> np.ndarray:
    """target token id -> draft id (-1 outside the draft vocabulary)."""
    to_draft = np.full(int(max(trunk.vocab_size, teacher.top_ids.max() + 1)), -1, np.int64)
    to_draft[draft_vocab] = np.arange(len(draft_vocab))
    return to_draft


@dataclass
class TrainResult:
    steps: int = 0
    seconds: float = 0.0
    tokens_seen: int = 0
    losses: list[float] = field(default_factory=list)
    agreement: list[float] = field(default_factory=list)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup to ``peak``, then cosine decay to 10% of it at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(
    module: NextNModule,
    trunk: Trunk,
    seqs: Sequences,
    teacher: Teacher,
    draft_vocab: np.ndarray,
    *,
    seed: int,
    seq_len: int,
    batch_size: int,
    lr: float,
    deadline: float,
    max_steps: int | None = None,
    warmup: int = 30,
    depth2_weight: float = 0.0,
    on_step: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Train until ``max_steps`` or ``deadline`` (``time.monotonic()``). Without
    ``max_steps`` the cosine horizon is estimated from the speed of the first steps."""
    rng = np.random.default_rng(seed)
    mx.random.seed(seed)
    to_draft = _draft_index(trunk, teacher, draft_vocab)
    windows = Windows.cut(seqs, seq_len)
    optimizer = optim.AdamW(learning_rate=lr, weight_decay=0.01)
    value_and_grad = nn.value_and_grad(module, lambda m, b: loss_fn(m, trunk, b, depth2_weight))
    state = [module.state, optimizer.state]

    def step(*arrays: mx.array) -> tuple[mx.array, mx.array]:
        (loss, agree), grads = value_and_grad(module, Batch(*arrays))
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(module, grads)
        return loss, agree

    compiled = mx.compile(step, inputs=state, outputs=state)
    result = TrainResult()
    total = max_steps or 10**9
    started = time.monotonic()
    order = rng.permutation(len(windows.start))
    cursor, timer = 0, started
    while result.steps < total and time.monotonic() < deadline:
        if cursor + batch_size > len(order):
            order, cursor = rng.permutation(len(windows.start)), 0
        chosen = order[cursor : cursor + batch_size]
        cursor += batch_size
        batch = make_batch(windows, chosen, seqs, teacher, to_draft, seq_len)
        optimizer.learning_rate = lr_at(result.steps, total, lr, warmup)
        loss, agree = compiled(*astuple(batch))
        mx.eval(loss, agree, state)
        n = float(batch.mask.sum().item())
        result.steps += 1
        result.tokens_seen += int(n)
        result.losses.append(float(loss.item()))
        result.agreement.append(float(agree.item()) / max(n, 1.0))
        if result.steps == 2:
            timer = time.monotonic()
        if max_steps is None and result.steps == 12:
            per_step = (time.monotonic() - timer) / 10
            total = max(20, 12 + int((deadline - time.monotonic()) / per_step * 0.97))
            logger.info("%.2f s/step: cosine horizon %d steps", per_step, total)
        if on_step is not None:
            on_step(result.steps, result.losses[-1])
        if result.steps % 25 == 0:
            recent = slice(-25, None)
            logger.info(
                "step %d loss %.3f top1 %.3f lr %.2e (%.0f tok/s)",
                result.steps,
                float(np.mean(result.losses[recent])),
                float(np.mean(result.agreement[recent])),
                lr_at(result.steps, total, lr, warmup),
                result.tokens_seen / (time.monotonic() - started),
            )
    result.seconds = time.monotonic() - started
    return result
