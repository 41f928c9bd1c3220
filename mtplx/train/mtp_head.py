"""Train an MTP draft head for a target with none: ``python -m mtplx.train.mtp_head``.

Stages (each cached under ``--out``, so a rerun resumes from the last finished one):

1. data     training prompts -> the target's own answers (+ stdlib source chunks)
            -> ``data/sequences.npz``; the frozen trunk's teacher pass -> ``data/teacher.npz``
2. train    the head against the teacher's next-token distribution at position i+1, for the
            minutes left of ``--minutes`` (``mtplx.train.loop``)
3. export   ``mtp.safetensors`` (float16, Qwen3-Next names + ``mtp.draft_vocab``), the loss
            curve and ``report.json`` / ``report.md``, with held-out acceptance
            (``mtplx.train.evaluate``) unless ``--no-eval``.

Everything is seeded: the same seed, data and step count give the same weights.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from mtplx.models.base import LoadedModel
from mtplx.train import data as data_mod
from mtplx.train.prompts import Prompt, build_prompts
from mtplx.train.prompts_broad import build_broad_prompts

logger = logging.getLogger("mtplx.train")

PROMPT_SOURCES = ("templates", "broad", "mix")


def training_prompts(source: str, seed: int, count: int) -> list[Prompt]:
    """``count`` training prompts: ``templates`` (``mtplx.train.prompts``, at most 1748),
    ``broad`` (``mtplx.train.prompts_broad``) or ``mix`` (broad, with every fourth prompt
    from the templates instead)."""
    if source == "templates":
        return build_prompts(seed, num_train=count)[0]
    broad = build_broad_prompts(seed, num_train=count)[0]
    if source == "broad":
        return broad
    templates = iter(build_prompts(seed, num_train=max(1, count // 4))[0])
    return [next(templates, b) if i % 4 == 3 else b for i, b in enumerate(broad)]


def prepare_data(
    model: LoadedModel,
    out: Path,
    *,
    seed: int,
    gen_minutes: float,
    num_prompts: int,
    rounds: int,
    max_answer_tokens: int,
    text_tokens: int,
    batch_size: int,
    top_k: int,
    prompt_source: str = "templates",
) -> tuple[data_mod.Sequences, data_mod.Teacher, dict[str, float]]:
    """Stage 1 (cached in ``out/data``): sequences and the teacher's view of them (captured
    while generating the chat answers; one teacher pass over the local text).

    Chat answers are saved batch by batch (``data/chat/batches-FIRST-LAST.npz``); a rerun
    resumes after the last saved batch for another ``gen_minutes``, and reuses the assembled
    ``sequences.npz`` / ``teacher.npz`` when no batch was added."""
    folder, chat_folder = out / "data", out / "data" / "chat"
    chat_folder.mkdir(parents=True, exist_ok=True)
    seq_path, teacher_path = folder / "sequences.npz", folder / "teacher.npz"
    text_path, info_path = folder / "text_teacher.npz", folder / "info.json"
    info: dict[str, Any] = json.loads(info_path.read_text()) if info_path.exists() else {}

    def shards() -> list[Path]:
        return sorted(chat_folder.glob("batches-*.npz"))

    done = max((int(p.stem.split("-")[2]) for p in shards()), default=-1)
    train_prompts = training_prompts(prompt_source, seed, num_prompts)
    started = time.monotonic()
    data_mod.generate_with_teacher(
        model,
        train_prompts,
        seed=seed,
        rounds=rounds,
        max_tokens=max_answer_tokens,
        deadline=started + 60 * gen_minutes,
        batch_size=batch_size,
        top_k=top_k,
        first_batch=done + 1,
        on_batch=lambda b, data: data.save(chat_folder / f"batches-{b:05d}-{b:05d}.npz"),
    )
    names = [p.name for p in shards()]
    if seq_path.exists() and teacher_path.exists() and info.get("chat_shards") == names:
        seqs = data_mod.Sequences.load(seq_path)
        teacher = data_mod.Teacher.load(teacher_path)
    else:
        info["generation_seconds"] = info.get("generation_seconds", 0.0) + (
            time.monotonic() - started
        )
        chat = data_mod.Generated([], [], [], [], [])
        for path in shards():
            chat.extend(data_mod.Generated.load(path))
        text = data_mod.local_text_chunks(model.tokenizer, max_tokens=text_tokens, seed=seed)
        text_seqs = data_mod.Sequences.build(text, [1] * len(text), [0] * len(text))
        if text_path.exists():
            text_teacher = data_mod.Teacher.load(text_path)
        else:
            text_started = time.monotonic()
            text_teacher = data_mod.teacher_pass(model, text_seqs, top_k=top_k)
            info["teacher_seconds"] = time.monotonic() - text_started
            text_teacher.save(text_path.with_suffix(".tmp.npz"))
            text_path.with_suffix(".tmp.npz").rename(text_path)
        seqs = data_mod.Sequences.build(
            chat.seqs + text, [0] * len(chat.seqs) + [1] * len(text), chat.starts + [0] * len(text)
        )
        teacher = data_mod.Teacher(
            np.concatenate([*chat.hidden, text_teacher.hidden]),
            np.concatenate([*chat.top_ids, text_teacher.top_ids]),
            np.concatenate([*chat.top_probs, text_teacher.top_probs]),
        )
        for obj, path in ((seqs, seq_path), (teacher, teacher_path)):
            obj.save(path.with_suffix(".tmp.npz"))
            path.with_suffix(".tmp.npz").rename(path)
        info["generated_tokens"] = float(
            sum(len(s) - a + 1 for s, a in zip(chat.seqs, chat.starts, strict=True))
        )
        info["chat_shards"] = names
        info_path.write_text(json.dumps(info, indent=2))
    info["tokens"] = float(len(seqs.tokens))
    info["unique_tokens"] = float(len(np.unique(seqs.tokens)))
    info["sequences"] = float(len(seqs))
    info["chat_sequences"] = float(int((seqs.source == 0).sum()))
    return seqs, teacher, info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mtplx.train.mtp_head", description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="output / cache directory")
    p.add_argument("--minutes", type=float, default=60.0, help="total wall-clock budget")
    p.add_argument("--model", default=None, help="target checkpoint (default: SmolLM2-135M)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--gen-minutes",
        type=float,
        default=None,
        help="generation minutes in this run (default: 40%% of budget); a rerun resumes "
        "after the batches already saved",
    )
    p.add_argument(
        "--num-prompts", type=int, default=1748, help="training prompts (templates: max 1748)"
    )
    p.add_argument(
        "--prompt-source",
        choices=PROMPT_SOURCES,
        default="templates",
        help="templates: mtplx.train.prompts; broad: mtplx.train.prompts_broad; mix: both "
        "(3:1); fixed for the life of a data folder (resuming indexes its prompt list)",
    )
    p.add_argument(
        "--init",
        type=Path,
        default=None,
        help="start from this head (mtp safetensors) and keep its draft vocabulary",
    )
    p.add_argument("--rounds", type=int, default=2, help="answers per prompt (greedy/sampled)")
    p.add_argument("--max-answer-tokens", type=int, default=192)
    p.add_argument("--text-tokens", type=int, default=30000, help="stdlib source tokens")
    p.add_argument("--gen-batch", type=int, default=64)
    p.add_argument("--top-k", type=int, default=32, help="teacher probabilities kept")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=30, help="linear warmup steps")
    p.add_argument("--depth2-weight", type=float, default=0.5, help="0: depth-1 loss only")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--data-only", action="store_true", help="stop after stage 1")
    p.add_argument("--no-eval", action="store_true", help="skip held-out evaluation")
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--eval-tokens", type=int, default=96)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    started = time.monotonic()
    deadline = started + 60 * args.minutes

    from mtplx.models import load
    from mtplx.models.gguf import ensure_default_model

    model_dir = Path(args.model) if args.model else ensure_default_model()
    model = load(model_dir, mtp_weights=None)
    args.out.mkdir(parents=True, exist_ok=True)
    gen_minutes = args.gen_minutes if args.gen_minutes is not None else 0.4 * args.minutes
    seqs, teacher, info = prepare_data(
        model,
        args.out,
        seed=args.seed,
        gen_minutes=gen_minutes,
        num_prompts=args.num_prompts,
        rounds=args.rounds,
        max_answer_tokens=args.max_answer_tokens,
        text_tokens=args.text_tokens,
        batch_size=args.gen_batch,
        top_k=args.top_k,
        prompt_source=args.prompt_source,
    )
    logger.info("data: %s", info)
    if args.data_only:
        return 0

    from mtplx.train.export import finish_run

    return finish_run(model, model_dir, seqs, teacher, info, args, deadline)


if __name__ == "__main__":
    raise SystemExit(main())
