"""The training report: loss / agreement curve (PNG via matplotlib, when installed) and a
JSON + Markdown summary with the held-out acceptance."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def smooth(values: list[float], window: int = 25) -> np.ndarray:
    """Trailing moving average (shorter at the start)."""
    arr = np.asarray(values, np.float64)
    if arr.size == 0:
        return arr
    cums = np.cumsum(np.insert(arr, 0, 0.0))
    idx = np.arange(1, arr.size + 1)
    lo = np.maximum(0, idx - window)
    return (cums[idx] - cums[lo]) / (idx - lo)


def plot_curve(losses: list[float], agreement: list[float], path: Path) -> Path | None:
    """Loss and top-1 agreement per step; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no loss curve")
        return None
    fig, left = plt.subplots(figsize=(7, 4))
    steps = np.arange(1, len(losses) + 1)
    left.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8)
    left.plot(steps, smooth(losses), color="tab:blue", label="soft CE (smoothed)")
    left.set_xlabel("step")
    left.set_ylabel("soft cross-entropy to teacher", color="tab:blue")
    right = left.twinx()
    right.plot(steps, smooth(agreement), color="tab:orange", label="top-1 agreement")
    right.set_ylabel("top-1 agreement with teacher", color="tab:orange")
    right.set_ylim(0, 1)
    left.set_title("MTP head training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(out: Path, report: dict[str, Any]) -> None:
    """``report.json`` and a human-readable ``report.md``."""
    (out / "report.json").write_text(json.dumps(report, indent=2))
    lines = ["# MTP head training report", ""]
    data, train = report.get("data", {}), report.get("train", {})
    lines += [
        f"- target: `{report.get('model')}`",
        f"- data: {int(data.get('tokens', 0))} tokens ({int(data.get('unique_tokens', 0))} "
        f"unique) in {int(data.get('sequences', 0))} sequences, "
        f"{int(data.get('chat_sequences', 0))} of them generated chat answers "
        f"({int(data.get('generated_tokens', 0))} generated tokens)",
        f"- draft vocabulary: {report.get('draft_vocab_size')} tokens, covering "
        f"{report.get('draft_vocab_coverage', 0):.1%} of the teacher's greedy tokens",
        f"- training: {train.get('steps')} steps in {train.get('seconds', 0) / 60:.1f} min, "
        f"{train.get('tokens_seen')} token positions; final loss "
        f"{train.get('final_loss', float('nan')):.3f}, top-1 agreement "
        f"{train.get('final_agreement', float('nan')):.1%}",
        f"- initial head (before training): predicts the token it is given (x[i+1]) at "
        f"{report.get('initial_head', {}).get('predicts_given_token', 0):.1%} of positions, "
        f"the teacher's x[i+2] at "
        f"{report.get('initial_head', {}).get('agrees_with_teacher', 0):.1%}",
        f"- head file: `{report.get('head_file')}` ({report.get('head_bytes', 0) / 1e6:.1f} MB)",
        "",
    ]
    evals = report.get("heldout", [])
    if evals:
        lines += [
            "## Held-out acceptance (engine, drafter mtp)",
            "",
            "| T | top_p | depth | acceptance by position | mean acceptance length | tokens |",
            "|---|---|---|---|---|---|",
        ]
        for r in evals:
            pos = ", ".join(f"{a:.1%}" for a in r["acceptance_per_position"])
            lines.append(
                f"| {r['temperature']} | {r['top_p']} | {r['depth']} | {pos} | "
                f"{r['mean_acceptance_length']:.2f} | {r['completion_tokens']} |"
            )
    if report.get("notes"):
        lines += ["", "## Notes", "", *[f"- {n}" for n in report["notes"]]]
    if report.get("curve"):
        lines += ["", f"![loss curve]({report['curve']})"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
