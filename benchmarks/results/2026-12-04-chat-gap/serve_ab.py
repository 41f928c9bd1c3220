"""Two running servers A and B (e.g. the code before and after a change), the same chat
prompts, turn about: for each prompt the four replies (A default, A plain, B default, B
plain) in an order rotating from prompt to prompt, as ``bench-serve --compare-plain`` times
them (decode tokens/s after the first content chunk, on the client's clock), plus each
server's main-thread (asyncio loop) CPU seconds per token from /proc.

    python serve_ab.py A_PID A_URL B_PID B_URL [repeats] > out.txt
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from mtplx.bench.prompts import load_prompts  # noqa: E402
from mtplx.bench.serve_bench import stream_one  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def main_thread_cpu(pid: int) -> float:
    """CPU seconds of ``pid``'s main thread (the server's asyncio loop)."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def run(servers: dict[str, tuple[int, str]], repeats: int) -> dict:
    prompts = load_prompts(ROOT / "benchmarks/prompts-more", ["chat"], 12)
    clients = {
        name: httpx.AsyncClient(base_url=url, timeout=600) for name, (_, url) in servers.items()
    }
    models = {n: (await c.get("/v1/models")).json()["data"][0]["id"] for n, c in clients.items()}
    sides = [(s, k) for s in servers for k in ("default", "plain")]
    records = []
    cpu = {s: 0.0 for s in servers}
    tokens = {s: 0 for s in servers}
    turn = 0
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            order = sides[turn % len(sides) :] + sides[: turn % len(sides)]
            turn += 1
            for server, kind in order:
                body = {
                    "model": models[server],
                    "messages": [{"role": "user", "content": prompt.text}],
                    "max_tokens": 96,
                    "temperature": 0,
                    "seed": index,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                if kind == "plain":
                    body["mtplx"] = {"depth": 0}
                before = main_thread_cpu(servers[server][0])
                reply = await stream_one(clients[server], body)
                cpu[server] += main_thread_cpu(servers[server][0]) - before
                tokens[server] += reply.tokens
                records.append(
                    {
                        "server": server,
                        "kind": kind,
                        "prompt": prompt.prompt_id,
                        "repeat": repeat,
                        "tokens": reply.tokens,
                        "decode_tps": reply.decode_tokens_per_s,
                        "text": reply.text,
                        "error": reply.error,
                        "acc": reply.mtplx.get("accepted_per_position"),
                        "drafted": reply.mtplx.get("drafted_per_position"),
                        "load": os.getloadavg()[0],
                    }
                )
    return {"records": records, "cpu": cpu, "tokens": tokens}


def main() -> None:
    a_pid, a_url, b_pid, b_url = sys.argv[1:5]
    repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    servers = {"A": (int(a_pid), a_url), "B": (int(b_pid), b_url)}
    print("load before", os.getloadavg())
    out = asyncio.run(run(servers, repeats))
    print("load after", os.getloadavg())
    records = out["records"]
    key = {(r["server"], r["kind"], r["prompt"], r["repeat"]): r for r in records}
    print()
    print(
        "| server | pairs | default/plain per pair, median (min-max) | aggregate | same text |"
        " loop CPU ms/token |"
    )
    print("|---|---|---|---|---|---|")
    ratios_by = {}
    for server in servers:
        pairs = [
            (key[(server, "default", p, r)], key[(server, "plain", p, r)])
            for (s, k, p, r) in key
            if s == server and k == "default"
        ]
        ratios = [d["decode_tps"] / p["decode_tps"] for d, p in pairs]
        ratios_by[server] = ratios
        d_time = sum((d["tokens"] - 1) / d["decode_tps"] for d, _ in pairs)
        p_time = sum((p["tokens"] - 1) / p["decode_tps"] for _, p in pairs)
        agg = p_time / d_time
        same = sum(d["text"] == p["text"] for d, p in pairs)
        loop = 1e3 * out["cpu"][server] / out["tokens"][server]
        print(
            f"| {server} | {len(pairs)} | {statistics.median(ratios):.3f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {agg:.3f} | {same}/{len(pairs)} | {loop:.3f} |"
        )
    b_over_a = [b / a for a, b in zip(ratios_by["A"], ratios_by["B"], strict=True)]
    print()
    print(f"B's ratio over A's, per prompt: median {statistics.median(b_over_a):.3f}")
    for side in ("default", "plain"):
        per = [
            key[("B", side, p, r)]["decode_tps"] / key[("A", side, p, r)]["decode_tps"]
            for (s, k, p, r) in key
            if s == "A" and k == side
        ]
        print(f"B/A decode tok/s, {side}: median {statistics.median(per):.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
