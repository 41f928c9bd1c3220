"""How far the integer-dot mode moves the default model from the float mode.

Runs the default model (its GGUF's Q4_1 / Q8_0 weights on the quantized kernel) once per
mode, each in a fresh process (``MTPLX_ACTIVATIONS`` is a process setting), and compares:

- teacher-forced next-token distributions over real text (this repository's README and
  docs): top-1 agreement of the greedy next token and mean KL(float32 || int8) in nats;
- greedy plain decoding of chat prompts: tokens equal before the first difference;
- the MTP head's acceptance rate at depths 1, 2 and 3 (greedy, fixed depth, the same
  prompts), per mode;
- with ``--llamacpp`` (llama-cpp-python installed: ``make install-llamacpp``): llama.cpp's
  teacher-forced logits on the same GGUF and tokens, as a third column (its Q4_1 / Q8_0 dot
  products quantize their rows to 8 bits too).

    python scripts/int8_quality.py [--positions 600] [--tokens 64] [--llamacpp]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [
    ROOT / "README.md",
    ROOT / "docs" / "speculative-decoding.md",
    ROOT / "docs" / "batching.md",
]
PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that checks whether a number is prime.",
    "List three tips for a good night's sleep.",
    "Describe a cat to someone who has never seen one.",
    "What is the capital of France, and what is it famous for?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
]


def worker(out: Path, positions: int, tokens: int) -> None:
    """Everything one mode needs, saved to ``out`` (.npz logits + .json)."""
    import importlib

    import mtplx  # noqa: F401  (the BLAS shim before MLX)
    from mtplx.engine import Engine
    from mtplx.models import load
    from mtplx.models.gguf import ensure_default_model
    from mtplx.models.quantized import activations_format
    from mtplx.request import FinishEvent, GenerationRequest, SamplerConfig, TokenEvent

    mx = importlib.import_module("mlx.core")  # after mtplx
    model = load(ensure_default_model("native"))
    owner = model.target.trunk.owner  # type: ignore[attr-defined]
    per_text = positions // len(TEXTS)
    logits, inputs = [], []
    for path in TEXTS:
        ids = model.tokenizer.encode(path.read_text())[: per_text + 1]
        out_logits = owner(mx.array(ids[:-1])[None])[0].astype(mx.float32)  # [T, V]
        logits.append(np.array(out_logits))
        inputs.append(ids[:-1])
    engine = Engine(model)
    greedy = SamplerConfig(temperature=0.0)

    def run(prompt: str, drafter: str, depth: int) -> tuple[list[int], list[int], list[int]]:
        ids = list(
            model.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True
            )
        )
        engine.add(
            GenerationRequest(
                prompt_ids=ids,
                sampler=greedy,
                max_tokens=tokens,
                ignore_eos=True,
                drafter=drafter,
                depth=depth,
            )
        )
        out_tokens: list[int] = []
        stats = None
        while engine.running:
            for _, event in engine.step():
                if isinstance(event, TokenEvent):
                    out_tokens.append(int(event.token_id))
                elif isinstance(event, FinishEvent):
                    stats = event.stats
        assert stats is not None
        return out_tokens, list(stats.drafted_per_position), list(stats.accepted_per_position)

    result: dict[str, object] = {
        "activations": activations_format(),
        "weights": model.weights,
        "inputs": inputs,
    }
    plain = [run(p, "none", 0)[0] for p in PROMPTS]
    result["plain"] = plain
    for depth in (1, 2, 3):
        drafted = [0] * depth
        accepted = [0] * depth
        same = True
        for prompt, want in zip(PROMPTS, plain, strict=True):
            got, d, a = run(prompt, "mtp", depth)
            same &= got == want  # exactness: speculative == plain under the same kernel
            for i in range(len(d)):
                drafted[i] += d[i]
                accepted[i] += a[i] if i < len(a) else 0
        result[f"mtp@{depth}"] = {"drafted": drafted, "accepted": accepted, "equals_plain": same}
    np.savez(out.with_suffix(".npz"), *logits)
    out.with_suffix(".json").write_text(json.dumps(result))


def llamacpp_logits(inputs: list[list[int]]) -> np.ndarray:
    """llama.cpp's next-token logits [T, V] for each text's tokens, on the default GGUF."""
    from llama_cpp import Llama

    from mtplx.models.gguf import default_gguf_path

    llm = Llama(
        model_path=str(default_gguf_path()),
        n_ctx=2048,
        n_threads=os.cpu_count(),
        logits_all=True,
        verbose=False,
    )
    out = []
    for ids in inputs:
        llm.reset()
        llm.eval(ids)
        out.append(np.array(llm.scores[: len(ids)], dtype=np.float32))
    return np.concatenate(out)


def _compare(name: str, f: np.ndarray, other: np.ndarray) -> None:
    lf, lo = _log_softmax(f), _log_softmax(other)
    kl = (np.exp(lf) * (lf - lo)).sum(axis=-1)
    top1 = (f.argmax(-1) == other.argmax(-1)).mean()
    print(f"{name}: top-1 agreement {100 * top1:.2f}%, KL mean {kl.mean():.5f} nats, "
          f"median {np.median(kl):.5f}, p99 {np.quantile(kl, 0.99):.4f}, max {kl.max():.4f}, "
          f"max |logit difference| {np.abs(f - other).max():.4f}")  # fmt: skip


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=600)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--llamacpp", action="store_true", help="add llama.cpp's logits")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.positions, args.tokens)
        return
    print(f"load before: {os.getloadavg()}")
    results, logits = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("float32", "int8"):
            out = Path(tmp) / mode
            env = dict(os.environ, MTPLX_ACTIVATIONS=mode, MTPLX_WEIGHTS="native")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
            subprocess.run(
                [sys.executable, __file__, "--worker", str(out), "--positions",
                 str(args.positions), "--tokens", str(args.tokens)],
                check=True, env=env,
            )  # fmt: skip
            results[mode] = json.loads(out.with_suffix(".json").read_text())
            with np.load(out.with_suffix(".npz")) as data:
                logits[mode] = np.concatenate([data[k] for k in data.files])
    print(f"load after: {os.getloadavg()}")
    f, i = logits["float32"], logits["int8"]
    lf, li = _log_softmax(f), _log_softmax(i)
    kl = (np.exp(lf) * (lf - li)).sum(axis=-1)
    top1 = (f.argmax(-1) == i.argmax(-1)).mean()
    print(f"weights: {results['int8']['weights']}")
    print(f"teacher-forced positions: {f.shape[0]} (texts: {', '.join(p.name for p in TEXTS)})")
    print(f"top-1 agreement: {100 * top1:.2f}%")
    print(f"KL(float32 || int8): mean {kl.mean():.5f} nats, median {np.median(kl):.5f}, "
          f"p99 {np.quantile(kl, 0.99):.4f}, max {kl.max():.4f}")  # fmt: skip
    print(f"max |logit difference|: {np.abs(f - i).max():.4f} (logit std {f.std():.3f})")
    if args.llamacpp:
        sys.path.insert(0, str(ROOT))
        llama = llamacpp_logits(results["float32"]["inputs"])
        _compare("llama.cpp vs float32", f, llama)
        _compare("llama.cpp vs int8", i, llama)
    same = []
    for a, b in zip(results["float32"]["plain"], results["int8"]["plain"], strict=True):
        n = next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        same.append(n)
    print(f"greedy plain decoding, tokens equal before the first difference: {same} "
          f"(of {args.tokens} each)")  # fmt: skip
    print("| depth | float32 acceptance by position | int8 acceptance by position | "
          "spec == plain (float32 / int8) |")  # fmt: skip
    print("|---|---|---|---|")
    for depth in (1, 2, 3):
        cells = []
        for mode in ("float32", "int8"):
            r = results[mode][f"mtp@{depth}"]
            rates = [a / d if d else 0.0 for a, d in zip(r["accepted"], r["drafted"], strict=True)]
            total = sum(r["accepted"]) / max(1, sum(r["drafted"]))
            cells.append(" / ".join(f"{x:.2f}" for x in rates) + f" (all {total:.2f})")
        eq = f"{results['float32'][f'mtp@{depth}']['equals_plain']} / "
        eq += f"{results['int8'][f'mtp@{depth}']['equals_plain']}"
        print(f"| {depth} | {cells[0]} | {cells[1]} | {eq} |")


if __name__ == "__main__":
    main()
