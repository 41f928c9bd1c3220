"""The ``mtplx bench`` subcommand: arguments, and the run that writes the reports."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

QUICK = {
    "max_tokens": 64,
    "repeats": 2,
    "prompts_per_category": 1,
    "modes": "plain,plain-f32,default,mtp@2,mtp@4,draft,ngram,mlxlm-plain,mlxlm-spec,llamacpp",
}


def _csv(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def add_bench_parser(commands: Any) -> argparse.ArgumentParser:
    """The ``bench`` subcommand."""
    p = commands.add_parser(
        "bench",
        help="benchmark plain decoding vs every drafter, and vs mlx-lm, on one model",
        description="Paired, interleaved runs; medians and spreads; JSON, Markdown and PNG.",
    )
    p.add_argument("model", nargs="?", help="checkpoint path or id (default: shipped model)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="1 prompt a category, 64 tokens, 2 "
        "repeats, a subset of modes (explicit options still win)",
    )
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument(
        "--samplers",
        type=_csv,
        default=["greedy", "t0.6"],
        help="greedy (T=0) and/or t0.6 (T=0.6, top_p 0.95, top_k 20)",
    )
    p.add_argument("--categories", type=_csv, help="prompt files to use (default: all)")
    p.add_argument("--prompts-per-category", type=int)
    p.add_argument("--prompt-dir", type=Path, help="directory of <category>.jsonl files")
    p.add_argument(
        "--modes",
        type=_csv,
        help="plain,default,mtp,mtp@K,mtp-adaptive,draft,"
        "ngram,mlxlm-plain,mlxlm-spec,llamacpp (default: all)",
    )
    p.add_argument("--mtp-depths", type=int, default=5, help="'mtp' runs depths 1..this")
    p.add_argument(
        "--draft-layers", type=int, help="layer-skip draft depth N (default: chosen by measurement)"
    )
    p.add_argument(
        "--draft-depth",
        type=int,
        default=3,
        help="draft tokens per cycle for the draft model, ours and mlx-lm's",
    )
    p.add_argument("--ngram-depth", type=int, default=4)
    p.add_argument(
        "--gguf",
        type=Path,
        help="llama.cpp's model (default: the GGUF the checkpoint was converted from)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="results folder (default results/bench-<time>/)")
    p.add_argument("--no-progress", action="store_true")
    return p


def add_bench_serve_parser(commands: Any) -> argparse.ArgumentParser:
    """The ``bench-serve`` subcommand."""
    p = commands.add_parser("bench-serve", help="load-test a running mtplx (or any OpenAI) server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated levels")
    p.add_argument("--requests", type=int, help="requests per level (default max(c, 4))")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--api-key")
    p.add_argument("--out", type=Path, help="folder for serve.json and serve.md")
    p.add_argument(
        "--admission",
        type=int,
        default=0,
        metavar="STREAMS",
        help="also measure the running streams' inter-token gaps while a long prompt is "
        "admitted among STREAMS streams (0: skip)",
    )
    p.add_argument("--admission-prompt-tokens", type=int, default=1500)
    compare = p.add_argument_group(
        "speculative vs plain (--compare-plain; --max-tokens and --out apply too)"
    )
    compare.add_argument(
        "--compare-plain",
        action="store_true",
        help="instead of load levels: each prompt twice, speculative and plain decoding, "
        "in alternating order; per-pair decode speed ratios and acceptance",
    )
    compare.add_argument("--temperatures", default="0,0.6", help="comma-separated")
    compare.add_argument("--repeats", type=int, default=2)
    compare.add_argument("--categories", type=_csv, default=["chat"], help="prompt files")
    compare.add_argument("--prompts-per-category", type=int)
    compare.add_argument("--prompt-dir", type=Path, help="directory of <category>.jsonl files")
    compare.add_argument("--drafter", help="the speculative side's drafter (default: the server's)")
    compare.add_argument("--depth", type=int, help="its draft depth (default: the server's)")
    return p


def bench(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the benchmark and write results.json, results.md and speedup.png."""
    from mtplx.bench.prompts import DEFAULT_PROMPT_DIR
    from mtplx.bench.report import summarize, write_reports
    from mtplx.bench.runner import ALL_MODES, BenchConfig, run_bench
    from mtplx.commands import resolve_model

    quick = QUICK if args.quick else {}
    modes = args.modes or _csv(quick.get("modes", ",".join(ALL_MODES)))
    config = BenchConfig(
        model=resolve_model(args.model),
        max_tokens=args.max_tokens or quick.get("max_tokens", 128),
        repeats=args.repeats or quick.get("repeats", 3),
        samplers=args.samplers,
        categories=args.categories,
        prompts_per_category=args.prompts_per_category or quick.get("prompts_per_category"),
        modes=modes,
        mtp_depths=args.mtp_depths,
        draft_depth=args.draft_depth,
        ngram_depth=args.ngram_depth,
        draft_layers=args.draft_layers,
        prompt_dir=str(args.prompt_dir or DEFAULT_PROMPT_DIR),
        gguf=str(args.gguf) if args.gguf else None,
        seed=args.seed,
        progress=not args.no_progress,
    )
    out = args.out or Path("results") / time.strftime("bench-%Y%m%d-%H%M%S", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    with (out / "records.jsonl").open("w") as log:

        def on_record(record: dict[str, Any]) -> None:
            log.write(json.dumps(record) + "\n")
            log.flush()

        try:
            result = run_bench(config, on_record=on_record)
        except ValueError as exc:
            print(f"mtplx bench: {exc}", file=sys.stderr)
            return 2
    command = "mtplx " + shlex.join(argv if argv is not None else sys.argv[1:])
    paths = write_reports(result, out, command)
    for row in summarize(result):
        if row["category"] == "all":
            print(
                f"{row['sampler']:>6} {row['mode']:<16} {row['decode_tps']['median']:7.2f} tok/s "
                f"x{row['speedup']['median']:.2f}  acc.len {row['mean_acceptance_length']:.2f}"
            )
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0
