"""CPU seconds per streamed token, by thread of a running ``mtplx serve`` (from
/proc/PID/task/*/stat) and of this client, for plain and speculative chat replies:
the serving path's share (the asyncio loop on the main thread) beside the engine's.
CPU time, not wall: a loaded host slows every thread's wall alike, not its CPU.

    python serve_threads.py PID URL [rounds]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from mtplx.bench.prompts import load_prompts  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> dict[int, tuple[str, float]]:
    """{tid: (comm, cpu seconds)} of ``pid``'s threads."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(task.name)] = (comm, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def stream(client: httpx.Client, body: dict) -> int:
    """Stream one chat completion; its completion tokens."""
    tokens = 0
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens


def main() -> None:
    pid, url = int(sys.argv[1]), sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    root = Path(__file__).resolve().parents[3]
    prompts = load_prompts(root / "benchmarks/prompts-more", ["chat"], 12)
    client = httpx.Client(base_url=url, timeout=600)
    model = client.get("/v1/models").json()["data"][0]["id"]
    totals: dict[str, dict] = {}
    for r in range(rounds):
        sides = ["plain", "default"] if r % 2 == 0 else ["default", "plain"]
        for side in sides:
            before, c0 = threads(pid), time.process_time()
            tokens = 0
            for prompt in prompts:
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": prompt.text}],
                    "max_tokens": 96,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                if side == "plain":
                    body["mtplx"] = {"depth": 0}
                tokens += stream(client, body)
            after, c1 = threads(pid), time.process_time()
            t = totals.setdefault(side, {"tokens": 0, "client": 0.0, "threads": {}})
            t["tokens"] += tokens
            t["client"] += c1 - c0
            for tid, (comm, cpu) in after.items():
                used = cpu - before.get(tid, (comm, 0.0))[1]
                name = "main (asyncio loop)" if tid == pid else f"{comm} {tid}"
                t["threads"][name] = t["threads"].get(name, 0.0) + used
    print(f"load: {os.getloadavg()}")
    for side, t in totals.items():
        n = t["tokens"]
        print(f"## {side}: {n} tokens; client {1e3 * t['client'] / n:.3f} ms CPU/token")
        for name, cpu in sorted(t["threads"].items(), key=lambda kv: -kv[1]):
            if cpu > 0:
                print(f"  {name}: {1e3 * cpu / n:.3f} ms CPU/token")
    print(json.dumps(totals))


if __name__ == "__main__":
    main()
