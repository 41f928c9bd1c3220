"""Summaries and reports of a benchmark run: JSON (config, machine, raw records, summary),
a Markdown table per sampler with the issue's bars checked, and a PNG chart of speedups."""

from __future__ import annotations

import json
import math
import resource
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mtplx.bench.runner import BenchResult
from mtplx.bench.stats import (
    acceptance_per_position,
    paired_speedups,
    pooled_acceptance_length,
    spread,
)


def summarize(result: BenchResult) -> list[dict[str, Any]]:
    """One row per (sampler, category, mode): decode tok/s and speedup over our plain
    decoding (median and spread of per-pair ratios), TTFT, acceptance, memory; plus an
    "all" category pooling every prompt."""
    records = result.records
    speedups = paired_speedups(records)
    speedups_all = paired_speedups([{**r, "category": "all"} for r in records])
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        groups[(record["sampler"], record["category"], record["mode"])].append(record)
        groups[(record["sampler"], "all", record["mode"])].append(record)
    plain_tokens = {
        (r["sampler"], r["prompt_id"], r["repeat"]): r["token_ids"]
        for r in records
        if r["mode"] == "plain"
    }
    rows = []
    for (sampler, category, mode), runs in groups.items():
        ratios = (speedups_all if category == "all" else speedups).get(
            (sampler, category, mode), []
        )
        same = [
            r["token_ids"] == plain_tokens.get((sampler, r["prompt_id"], r["repeat"])) for r in runs
        ]
        rows.append(
            {
                "sampler": sampler,
                "category": category,
                "mode": mode,
                "backend": runs[0]["backend"],
                "runs": len(runs),
                "decode_tps": spread(r["decode_tps"] for r in runs).as_dict(),
                "speedup": spread(ratios).as_dict(),
                "ttft_s": spread(r["ttft_s"] for r in runs).as_dict(),
                "mean_acceptance_length": pooled_acceptance_length(
                    (r["num_accepted"] for r in runs), (r["num_cycles"] for r in runs)
                ),
                "acceptance_per_position": acceptance_per_position(
                    (r["accepted_per_position"] for r in runs),
                    (r["drafted_per_position"] for r in runs),
                ),
                "peak_memory_mb": max(
                    (r["peak_memory_mb"] for r in runs if r["peak_memory_mb"] is not None),
                    default=None,
                ),
                "same_tokens_as_plain": sum(same) / len(same),
            }
        )
    order = {m["name"]: i for i, m in enumerate(result.modes)}
    categories = _categories(result)
    rows.sort(key=lambda r: (r["sampler"], categories.index(r["category"]), order[r["mode"]]))
    return rows


def _categories(result: BenchResult) -> list[str]:
    seen: list[str] = []
    for record in result.records:
        if record["category"] not in seen:
            seen.append(record["category"])
    return [*seen, "all"]


def check_bars(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's bars, each with the measured value and met / missed (absent modes: n/a)."""
    index = {(r["sampler"], r["category"], r["mode"]): r for r in rows}

    def find(sampler: str, category: str, prefix: str) -> list[dict[str, Any]]:
        return [
            r
            for (s, c, m), r in index.items()
            if s == sampler and c == category and (m == prefix or m.startswith(prefix + "@"))
        ]

    bars: list[dict[str, Any]] = []

    def add(name: str, value: float | None, threshold: float, detail: str = "") -> None:
        ok = None if value is None or math.isnan(value) else value >= threshold
        bars.append(
            {"bar": name, "value": value, "threshold": threshold, "met": ok, "detail": detail}
        )

    for sampler, threshold in (("greedy", 1.2), ("t0.6", 1.1)):
        best = max(find(sampler, "all", "mtp"), key=lambda r: r["speedup"]["median"], default=None)
        add(
            f"mtp vs plain, {sampler}",
            best["speedup"]["median"] if best else None,
            threshold,
            best["mode"] if best else "no MTP head",
        )
    for sampler in ("greedy", "t0.6"):
        best = max(
            find(sampler, "repeat", "ngram"), key=lambda r: r["speedup"]["median"], default=None
        )
        add(f"ngram on repeat, {sampler}", best["speedup"]["median"] if best else None, 1.8)
    for (sampler, category, mode), row in index.items():
        if mode == "default" and category != "all":
            add(f"default on {category}, {sampler}", row["speedup"]["median"], 0.97)
    for sampler in ("greedy", "t0.6"):
        ours = index.get((sampler, "all", "plain"))
        theirs = index.get((sampler, "all", "mlxlm-plain"))
        if ours and theirs:
            add(
                f"our plain / mlx-lm plain, {sampler}",
                ours["decode_tps"]["median"] / theirs["decode_tps"]["median"],
                0.95,
            )
    ours_draft = find("t0.6", "all", "draft")
    theirs_draft = find("t0.6", "all", "mlxlm-spec")
    if ours_draft and theirs_draft:
        diff = ours_draft[0]["mean_acceptance_length"] - theirs_draft[0]["mean_acceptance_length"]
        add("acceptance length: ours - mlx-lm, t0.6, same draft", diff, 0.2)
    return bars


def _fmt_spread(s: dict[str, Any], digits: int = 1, suffix: str = "") -> str:
    if not s["n"] or math.isnan(s["median"]):
        return "–"
    return f"{s['median']:.{digits}f}{suffix} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def markdown(result: BenchResult, rows: list[dict[str, Any]], command: str) -> str:
    """The report: command, machine, one table per sampler, then the bars."""
    m = result.machine
    blas = m.get("blas", {})
    lines = [
        f"# MTPLX benchmark — {result.config['model']}",
        "",
        f"- command: `{command}`",
        f"- started {result.started}, {result.elapsed_s / 60:.1f} min",
        f"- machine: {m.get('cpu_model', '?')}, {m.get('cpus', '?')} CPUs, {m.get('platform')}; "
        f"MLX {m.get('mlx')} ({m.get('device')}), mlx-lm {m.get('mlx_lm', '?')}",
        f"- lscpu: {'; '.join(f'{k}: {v}' for k, v in m.get('lscpu', {}).items())}; "
        f"memory {m.get('memory_gb', '?')} GB",
        f"- BLAS: {blas.get('name')} ({blas.get('library') or 'reference'}), "
        f"{blas.get('threads')} thread(s)",
        f"- load average at start {m.get('load_average')}, at end {m.get('load_average_end')}",
        f"- {result.config['max_tokens']} tokens per run (EOS ignored), "
        f"{result.config['repeats']} repeats, mode order rotated per repeat",
        f"- layer-skip draft: {result.draft_layers} layers"
        + (
            f" (measured greedy tok/s by N: {_calibration(result.draft_calibration)})"
            if result.draft_calibration
            else ""
        ),
        *(
            [
                "- llama.cpp (llama-cpp-python "
                + str(result.machine.get("llama_cpp", "?"))
                + "): "
                + "; ".join(f"llamacpp-{v}: `{p}`" for v, p in result.llamacpp.items())
            ]
            if result.llamacpp
            else []
        ),
        "",
        "decode tok/s = tokens after the first / time after the first; speedup = per-pair ratio "
        "over our plain decoding in the same repeat (median, then min–max); mean acc. len = "
        "tokens per verify forward; acc./pos. = acceptance rate at draft position 1, 2, …",
        "",
    ]
    for sampler in dict.fromkeys(r["sampler"] for r in rows):
        lines += [f"## {sampler}", ""]
        lines += [
            "| category | mode | decode tok/s | speedup | mean acc. len | acc./pos. | TTFT ms "
            "| peak MB | = plain (T=0) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if r["sampler"] != sampler:
                continue
            ttft = {k: v * 1e3 if isinstance(v, float) else v for k, v in r["ttft_s"].items()}
            per_pos = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"]) or "–"
            mal = r["mean_acceptance_length"]
            drafting = not math.isnan(mal)  # nan: no verify forward checked a draft
            mal_text = f"{mal:.2f}" if drafting else "–"
            # Token equality with plain decoding is the exactness check at T=0 only; sampled
            # runs draw different uniforms per mode, so they legitimately differ.
            same = f"{r['same_tokens_as_plain']:.0%}" if sampler == "greedy" else "–"
            peak = "–" if r["peak_memory_mb"] is None else f"{r['peak_memory_mb']:.0f}"
            lines.append(
                f"| {r['category']} | {r['mode']} | {_fmt_spread(r['decode_tps'])} "
                f"| {_fmt_spread(r['speedup'], 2, 'x')} "
                f"| {mal_text} "
                f"| {per_pos} | {_fmt_spread(ttft, 0)} | {peak} "
                f"| {same} |"
            )
        lines.append("")
    lines += ["## Bars", "", "| bar | value | threshold | met |", "|---|---|---|---|"]
    for bar in check_bars(rows):
        value = "n/a" if bar["value"] is None else f"{bar['value']:.2f}"
        met = {True: "yes", False: "**no**", None: "n/a"}[bar["met"]]
        detail = f" ({bar['detail']})" if bar["detail"] else ""
        lines.append(f"| {bar['bar']}{detail} | {value} | {bar['threshold']} | {met} |")
    lines.append("")
    return "\n".join(lines)


def _calibration(calibration: dict[int, float]) -> str:
    return ", ".join(f"N={n}: {tps:.1f}" for n, tps in sorted(calibration.items()))


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    """Grouped bars of median speedup over our plain decoding (whiskers: min–max), one panel
    per sampler, categories along x, one bar per mode."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on servers or in CI
    import matplotlib.pyplot as plt

    samplers = list(dict.fromkeys(r["sampler"] for r in rows))
    fig, axes = plt.subplots(1, len(samplers), figsize=(7 * len(samplers), 4.5), squeeze=False)
    for ax, sampler in zip(axes[0], samplers, strict=True):
        mine = [r for r in rows if r["sampler"] == sampler and r["mode"] != "plain"]
        categories = list(dict.fromkeys(r["category"] for r in mine))
        modes = list(dict.fromkeys(r["mode"] for r in mine))
        width = 0.8 / max(len(modes), 1)
        for j, mode in enumerate(modes):
            xs, ys, lo, hi = [], [], [], []
            for i, category in enumerate(categories):
                row = next(
                    (r for r in mine if r["category"] == category and r["mode"] == mode), None
                )
                if row is None or not row["speedup"]["n"]:
                    continue
                s = row["speedup"]
                xs.append(i + (j - (len(modes) - 1) / 2) * width)
                ys.append(s["median"])
                lo.append(s["median"] - s["min"])
                hi.append(s["max"] - s["median"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=mode)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(categories)), categories)
        ax.set_ylabel("decode speedup over our plain")
        ax.set_title(sampler)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(result: BenchResult, out_dir: Path, command: str) -> dict[str, Path]:
    """results.json, results.md and speedup.png in ``out_dir`` (created)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summarize(result)
    result.machine["ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    paths = {
        "json": out_dir / "results.json",
        "markdown": out_dir / "results.md",
        "png": out_dir / "speedup.png",
    }
    payload = {**asdict(result), "command": command, "summary": rows, "bars": check_bars(rows)}
    paths["json"].write_text(json.dumps(payload, indent=1, default=str) + "\n")
    paths["markdown"].write_text(markdown(result, rows, command))
    chart(rows, paths["png"])
    return paths
