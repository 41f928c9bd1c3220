"""A mixed soak against a local server with an API key: worker threads send streaming and
non-streaming chat, completions, Anthropic messages, streams cut off mid-way, and bad
inputs, for a fixed time; the server's RSS is sampled every 10 s. A request is *lost* when
it got no HTTP reply (or a stream without its end marker) although the client did not
leave. Prints one JSON object.

    python soak.py --port 8130 --key KEY --pid SERVER_PID --seconds 300
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from collections import Counter

import httpx


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


BAD = [
    {"messages": []},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
    {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
    {"messages": [{"role": "user", "content": "x"}], "n": 10_000},
    {"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5},
    {"messages": [{"role": "user", "content": "x"}], "mtplx": {"regex": "[^\\s\\S]"}},
    {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999999": 1}},
    {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "nope"}},
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8130)
    p.add_argument("--key", required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--workers", type=int, default=6)
    args = p.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    headers = {"Authorization": f"Bearer {args.key}", "x-api-key": args.key}
    model = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
    deadline = time.monotonic() + args.seconds
    lock = threading.Lock()
    statuses: Counter = Counter()
    kinds: Counter = Counter()
    lost: list[str] = []
    five_xx: list[str] = []
    rss: list[tuple[float, float]] = []
    started = time.monotonic()

    def record(kind: str, status: int, text: str = "") -> None:
        with lock:
            kinds[kind] += 1
            statuses[status] += 1
            if status >= 500:
                five_xx.append(f"{kind} {status} {text[:200]}")

    def one(client: httpx.Client, rng: random.Random) -> None:
        kind = rng.choice(["chat", "chat_stream", "completion", "messages", "messages_stream",
                           "cut_stream", "bad", "bad"])  # fmt: skip
        user = [{"role": "user", "content": f"Tell me about {rng.choice(['cats', 'rain', 'go'])}"}]
        max_tokens = rng.choice([4, 16, 48])
        try:
            if kind == "chat":
                r = client.post("/v1/chat/completions", json={
                    "model": model, "messages": user, "max_tokens": max_tokens,
                    "n": rng.choice([1, 1, 2])})  # fmt: skip
                record(kind, r.status_code, r.text)
            elif kind == "completion":
                r = client.post("/v1/completions", json={
                    "model": model, "prompt": "Once upon a time", "max_tokens": max_tokens,
                    "logprobs": rng.choice([None, 2])})  # fmt: skip
                record(kind, r.status_code, r.text)
            elif kind == "messages":
                r = client.post("/v1/messages", json={
                    "model": model, "messages": user, "max_tokens": max_tokens})  # fmt: skip
                record(kind, r.status_code, r.text)
            elif kind in ("chat_stream", "messages_stream"):
                path = "/v1/chat/completions" if kind == "chat_stream" else "/v1/messages"
                body = {"model": model, "messages": user, "max_tokens": max_tokens,
                        "stream": True}  # fmt: skip
                with client.stream("POST", path, json=body) as r:
                    text = "".join(r.iter_text())
                    end = "[DONE]" if kind == "chat_stream" else "message_stop"
                    if r.status_code == 200 and end not in text:
                        with lock:
                            lost.append(f"{kind}: stream without {end}: {text[-200:]}")
                    record(kind, r.status_code, text)
            elif kind == "cut_stream":
                body = {"model": model, "messages": user, "max_tokens": 64, "stream": True}
                with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    for i, _ in enumerate(r.iter_lines()):
                        if i >= 3:
                            break
                    record(kind, r.status_code)
            else:
                body = {"model": model, **rng.choice(BAD)}
                r = client.post("/v1/chat/completions", json=body)
                record(kind, r.status_code, r.text)
                if r.status_code != 400 and r.status_code != 429:
                    with lock:
                        lost.append(f"bad input answered {r.status_code}: {body}")
        except httpx.HTTPError as exc:
            with lock:
                lost.append(f"{kind}: {type(exc).__name__}: {exc}")

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            with httpx.Client(base_url=url, headers=headers, timeout=300) as client:
                one(client, rng)

    def sampler() -> None:
        while time.monotonic() < deadline:
            rss.append((round(time.monotonic() - started), round(rss_mb(args.pid))))
            time.sleep(10)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.workers)]
    threads.append(threading.Thread(target=sampler))
    load_start = os.getloadavg()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rss.append((round(time.monotonic() - started), round(rss_mb(args.pid))))
    health = httpx.get(f"{url}/health").json()
    out = {
        "seconds": args.seconds,
        "workers": args.workers,
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "requests": sum(kinds.values()),
        "kinds": dict(kinds),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "lost": len(lost),
        "lost_examples": lost[:10],
        "five_xx": len(five_xx),
        "five_xx_examples": five_xx[:10],
        "rss_mb": rss,
        "health_at_end": {k: health[k] for k in ("status", "queue", "batch")},
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
