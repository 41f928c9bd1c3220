"""KV store copies (``fused_layer.store_copies``) over greedy requests of the default model,
plain and depth-1 MTP, one stream: a steady decode loop writes its stores (the trunk's and
the MTP head's cache) in place, so should add none."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

# ruff: noqa: I001  (mtplx routes BLAS before MLX loads: it is imported first)
import mtplx  # noqa: F401

from mtplx import fused_layer
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig


def main() -> None:
    engine = Engine(load(ensure_default_model("native")))
    engine.warm_up()
    ids = list(
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Explain why the sky is blue."}],
            add_generation_prompt=True,
        )
    )
    for drafter, depth in (("none", 0), ("mtp", 1), ("mtp", 3)):
        engine.add(
            GenerationRequest(
                prompt_ids=ids,
                sampler=SamplerConfig(temperature=0.0),
                max_tokens=300,
                ignore_eos=True,
                drafter=drafter,
                depth=depth,
            )
        )
        engine.step()  # the prompt (its first writes may copy a fresh store)
        engine.step()
        before = fused_layer.store_copies()
        steps = 0
        while engine.running:
            engine.step()
            steps += 1
        print(f"{drafter}@{depth}: {steps} steps, {fused_layer.store_copies() - before} copies")


if __name__ == "__main__":
    main()
