"""Stages 2-3 of the training program: train the head, write it, evaluate it on the held-out
prompts, and write the report (see ``mtplx.train.mtp_head``)."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from mtplx.models.base import LoadedModel
from mtplx.train.data import Sequences, Teacher, draft_vocabulary
from mtplx.train.head import init_head, load_head, save_head, trainable
from mtplx.train.loop import initial_behaviour, train
from mtplx.train.report import plot_curve, write_report

logger = logging.getLogger(__name__)

EVAL_RESERVE_S = 240.0  # wall-clock kept for the held-out evaluation when it is on


def finish_run(
    model: LoadedModel,
    model_dir: Path,
    seqs: Sequences,
    teacher: Teacher,
    info: dict[str, float],
    args: argparse.Namespace,
    deadline: float,
) -> int:
    """Train, save ``args.out / 'mtp.safetensors'``, evaluate, report."""
    trunk = model.target.trunk
    init_from = getattr(args, "init", None)
    if init_from is not None:
        module, draft_vocab = load_head(trunk, init_from)
    else:
        draft_vocab = draft_vocabulary(seqs, teacher, args.draft_vocab)
        module = init_head(trunk, draft_vocab)
    best = teacher.top_ids[np.arange(len(teacher.top_ids)), teacher.top_probs.argmax(1)]
    coverage = float(np.isin(best, draft_vocab).mean())
    logger.info(
        "head: %d parameters, draft vocabulary %d (%.1f%% of greedy tokens)",
        trainable(module),
        len(draft_vocab),
        100 * coverage,
    )
    init = initial_behaviour(module, trunk, seqs, teacher, draft_vocab, args.seq_len)
    logger.info("initial head: %s", init)
    reserve = 0.0 if args.no_eval else EVAL_RESERVE_S
    result = train(
        module,
        trunk,
        seqs,
        teacher,
        draft_vocab,
        seed=args.seed,
        seq_len=args.seq_len,
        batch_size=args.batch,
        lr=args.lr,
        deadline=max(deadline - reserve, time.monotonic() + 30),
        max_steps=args.max_steps,
        depth2_weight=args.depth2_weight,
        warmup=getattr(args, "warmup", 30),
    )
    head_file = save_head(module, draft_vocab, args.out / "mtp.safetensors")
    tail = slice(-max(1, min(50, len(result.losses))), None)
    report: dict[str, Any] = {
        "model": str(model_dir),
        "seed": args.seed,
        "init": str(init_from) if init_from is not None else None,
        "data": info,
        "initial_head": init,
        "draft_vocab_size": len(draft_vocab),
        "draft_vocab_coverage": coverage,
        "train": {
            "steps": result.steps,
            "seconds": result.seconds,
            "tokens_seen": result.tokens_seen,
            "tokens_per_second": result.tokens_seen / max(result.seconds, 1e-9),
            "first_loss": result.losses[0] if result.losses else None,
            "final_loss": float(np.mean(result.losses[tail])) if result.losses else None,
            "final_agreement": float(np.mean(result.agreement[tail])) if result.losses else None,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "lr": args.lr,
            "warmup": getattr(args, "warmup", 30),
            "depth2_weight": args.depth2_weight,
        },
        "head_file": head_file.name,
        "head_bytes": head_file.stat().st_size,
        "notes": [
            f"depth-2 loss weight {args.depth2_weight}: the recursion step (own output + "
            "true next token, exact drafter attention context) is trained"
            if args.depth2_weight > 0
            else "depth-1 training only: deeper drafts recurse on the head's own output",
        ],
    }
    curve = plot_curve(result.losses, result.agreement, args.out / "loss_curve.png")
    report["curve"] = curve.name if curve else None
    np.save(args.out / "losses.npy", np.asarray([result.losses, result.agreement]))
    if not args.no_eval:
        from mtplx.train.evaluate import evaluate_head

        report["heldout"] = evaluate_head(
            model_dir,
            head_file,
            num_prompts=args.eval_prompts,
            max_tokens=args.eval_tokens,
            seed=args.seed,
        )
    write_report(args.out, report)
    logger.info("wrote %s and %s", head_file, args.out / "report.md")
    return 0
