"""Per-step CPU time of the engine's own step loop while short greedy streams decode beside
four long prompts prefilling at once (the default model, in process: no HTTP, no client).

Two budgets in one process, in turn: ``cost`` (the schedule as it is) and ``tokens`` (the
previous budget in tokens: the price of a key made negligible, so a chunk costs its tokens
alone). Each run: ``--shorts`` streams decode (a new one joins when one finishes), then
four long prompts join at once; the run ends when every long prompt has its first token.
Per step: CPU seconds (``time.process_time``: all threads of the process, steadier than
wall time on a loaded machine), whether a stream decoded in it, the prompt tokens fed.
Prints one JSON object.

    PYTHONPATH=. python steps_in_process.py [--lengths 3000,4000,4500,5000] [--shorts 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mtplx  # noqa: F401  (before mlx: the BLAS shim)
from mtplx.commands import resolve_model
from mtplx.engine import Engine
from mtplx.models import load
from mtplx.request import GenerationRequest
from mtplx.sampling import SamplerConfig
from mtplx.sequence import Status

GREEDY = SamplerConfig(temperature=0.0)


def _long_prompt(length: int, salt: int) -> list[int]:
    return [(salt * 7919 + 31 * j * j + 17 * j) % 40000 + 100 for j in range(length)]


def _short_request(index: int) -> GenerationRequest:
    prompt = [(index * 131 + 7 * j) % 40000 + 100 for j in range(30)]
    return GenerationRequest(prompt, GREEDY, 48, ignore_eos=True)


def run(engine: Engine, lengths: list[int], shorts: int) -> dict:
    """One run (see the module docstring): per-step records."""
    made = 0
    streams = []
    for _ in range(shorts):
        streams.append(engine.add(_short_request(made)))
        made += 1
    for _ in range(20):  # the streams decode before the long prompts come
        engine.step()
    longs = [
        engine.add(GenerationRequest(_long_prompt(n, i), GREEDY, 2, ignore_eos=True))
        for i, n in enumerate(lengths)
    ]
    steps = []
    while any(s.num_output_tokens == 0 and not s.finished for s in longs):
        fed_before = sum(s.num_prefilled for s in longs)
        prefilling = sum(s.status is Status.PREFILLING for s in longs)
        decoding = sum(s.status is Status.RUNNING for s in streams)
        cpu = time.process_time()
        engine.step()
        steps.append(
            {
                "cpu_s": round(time.process_time() - cpu, 3),
                "step": len(steps),
                "decoding": decoding,
                "prompt_tokens": sum(s.num_prefilled for s in longs) - fed_before,
                "prompts_done": prefilling - sum(s.status is Status.PREFILLING for s in longs),
            }
        )
        for i, stream in enumerate(streams):
            if stream.finished:
                engine.abort(stream)
                streams[i] = engine.add(_short_request(made))
                made += 1
    for sequence in list(engine.running):
        engine.abort(sequence)
    beside = [s["cpu_s"] for s in steps if s["decoding"]]
    # The steps in which a long prompt's last chunk went in, and the step after each (the
    # drafter takes the prompt's hidden states with its first token).
    ends = {i + k for i, s in enumerate(steps) if s["prompts_done"] for k in (0, 1)}
    during = [s["cpu_s"] for i, s in enumerate(steps) if s["decoding"] and i not in ends]
    return {
        "steps": len(steps),
        "steps_beside_streams": len(beside),
        "max_cpu_s_beside_streams": round(max(beside), 3),
        "median_cpu_s_beside_streams": round(statistics.median(beside), 3),
        "p90_cpu_s_beside_streams": round(sorted(beside)[int(0.9 * len(beside))], 3),
        "max_cpu_s_beside_streams_but_prompt_ends": round(max(during), 3),
        "cpu_s_at_prompt_ends": [
            round(steps[i]["cpu_s"], 3) for i in sorted(ends) if i < len(steps)
        ],
        "cpu_s_all_steps": round(sum(s["cpu_s"] for s in steps), 1),
        "slowest_steps": sorted(steps, key=lambda s: -s["cpu_s"])[:4],
        "max_prompt_tokens_a_step_beside_streams": max(
            s["prompt_tokens"] for s in steps if s["decoding"]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="3000,4000,4500,5000")
    parser.add_argument("--shorts", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    engine = Engine(load(resolve_model(None)), max_num_seqs=16)
    engine.warm_up()  # the step costs the server's adaptive rows plan with (cached)
    priced = engine.keys_per_token
    out: dict = {"load_avg_start": os.getloadavg(), "keys_per_token": priced, "runs": []}
    for _ in range(args.rounds):
        for budget in ("tokens", "cost"):
            # ``tokens``: a key's price negligible against a token's: the budget in tokens.
            engine.keys_per_token = 10**12 if budget == "tokens" else priced
            out["runs"].append({"budget": budget, **run(engine, lengths, args.shorts)})
            print(json.dumps(out["runs"][-1]), flush=True, file=__import__("sys").stderr)
    out["load_avg_end"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
