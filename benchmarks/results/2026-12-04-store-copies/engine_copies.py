"""KV store copies (``fused_layer.store_copies``) over plain sampled requests of the default
model, with the plain draw built three ways, and with ``pad`` extra trivial graph nodes
queued with each plain step's draw:

- ``two``: today's ``sampling.sample_logits``, the distribution node then the draw node;
- ``one``: one node drawing straight from the forward's logits (the extension's sampled
  verdict node with no drafts at temperature T: softmax and draw fused, MLX's bits);
- ``mlx``: MLX's own ops (``MTPLX_SAMPLED_KERNEL=0``'s path, ~10 nodes).

``pad`` adds that many nodes to each plain step: ``two`` / ``one`` / ``mlx``: int32 ``+ 0``
nodes after the draw (a Broadcast and an Add each, the tokens unchanged); ``one view``:
``stop_gradient`` nodes after the one-node draw (a view each: no kernel, only MLX's one
dispatch of a node's buffers); ``one apart``: ``+ 0`` nodes that share nothing with the step
(a chain from a fresh constant), added to the step's ``async_eval``. The tokens of every
variant must be the same.

    python engine_copies.py [tokens] [pads, comma separated] [rounds]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import mtplx  # noqa: F401  (first: it sets up the BLAS before mlx loads)

# isort: split
import mlx.core as mx

from mtplx import fused_layer, runner, sampling, speculative
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.models.gguf import ensure_default_model
from mtplx.request import GenerationRequest, TokenEvent
from mtplx.sampling import SamplerConfig

TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 48
PADS = [int(p) for p in (sys.argv[2] if len(sys.argv) > 2 else "0,1,2").split(",")]
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 2
TWO = sampling.sample_logits
NO_DRAFTS = mx.zeros((0,), mx.int32)


def one_node(logits, config, uniforms, token_counts=None, mask=None):  # type: ignore[no-untyped-def]
    """The draw in one node reading the logits (one row, no filters, no penalties)."""
    assert logits.shape[0] == 1 and token_counts is None and mask is None
    kernel = sampling.sampling_kernel()
    biased = sampling._biased(logits, config, None, None)
    _, tokens = kernel.sampled_verdict(biased, NO_DRAFTS, uniforms, [], config.temperature, 0, 0)
    return tokens.reshape(-1)


def with_pad(draw, pad, view=False):  # type: ignore[no-untyped-def]
    def padded(*args, **kwargs):  # type: ignore[no-untyped-def]
        token = draw(*args, **kwargs)
        for _ in range(pad):
            token = mx.stop_gradient(token) if view else token + 0
        return token

    return padded


class _Apart:
    """``runner``'s ``mx`` with ``apart`` unrelated nodes added to every ``async_eval``."""

    apart = 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(mx, name)

    def async_eval(self, *args) -> None:  # type: ignore[no-untyped-def]
        extra = mx.array([1], mx.int32)
        for _ in range(self.apart):
            extra = extra + 0
        mx.async_eval(*args, [extra] if self.apart else [])


APART = _Apart()
runner.mx = APART  # type: ignore[assignment]


def run(engine: Engine, seed: int) -> tuple[float, list[int]]:
    """One request: process CPU ms per token after the first, and its tokens."""
    request = GenerationRequest(
        prompt_ids=[1, 2, 3, 4, 5, 6, 7, 8],
        sampler=SamplerConfig(temperature=0.6, seed=seed),
        max_tokens=TOKENS,
        ignore_eos=True,
        drafter="none",
        depth=0,
    )
    tokens: list[int] = []
    events = engine.generate(request)
    for event in events:
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
            break
    c = time.process_time()
    for event in events:
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
    return 1e3 * (time.process_time() - c) / (len(tokens) - 1), tokens


def main() -> None:
    engine = Engine(load(ensure_default_model("native")))
    engine.warm_up()
    print(f"T=0.6 tokens={TOKENS} pads={PADS} rounds={ROUNDS}; load {os.getloadavg()}")
    kinds = ("two", "one", "one view", "one apart", "mlx")
    variants = [(kind, pad) for pad in PADS for kind in kinds]
    copies: dict[tuple[str, int], list[int]] = {v: [] for v in variants}
    cpu: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
    for r in range(ROUNDS):
        reference = None
        for kind, pad in variants if r % 2 == 0 else variants[::-1]:
            sampling._KERNEL_ON = kind != "mlx"
            draw = one_node if kind.startswith("one") else TWO
            APART.apart = pad if kind == "one apart" else 0
            pad_here = 0 if APART.apart else pad
            speculative.sample_logits = with_pad(draw, pad_here, view=kind == "one view")
            before = fused_layer.store_copies()
            ms, tokens = run(engine, seed=r)
            copies[(kind, pad)].append(fused_layer.store_copies() - before)
            cpu[(kind, pad)].append(ms)
            reference = reference or tokens
            assert tokens == reference, f"{kind} pad {pad}: other tokens"
        print(f"round {r} done; load {os.getloadavg()[0]:.2f}", flush=True)
    speculative.sample_logits, sampling._KERNEL_ON = TWO, True
    print("the same tokens in every variant and round")
    print("variant   pad  store copies per request    process CPU ms/token per request (median)")
    for kind, pad in variants:
        each = " ".join(f"{ms:.2f}" for ms in cpu[(kind, pad)])
        print(
            f"{kind:9} {pad:4}  {copies[(kind, pad)]!s:26}  {each} "
            f"({statistics.median(cpu[(kind, pad)]):.2f})"
        )
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
