"""A ~6,000-token prompt (a nonce first, so the prefix cache cannot serve it) with
``max_tokens: 1`` against a local server, with 4-token chats sent beside it one after
another and the server's RSS sampled from /proc. Prints one JSON object.

    python long_prompt.py --port 8130 --key KEY --pid SERVER_PID
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import threading
import time

import httpx


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8130)
    p.add_argument("--key", required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--tokens", type=int, default=6000)
    args = p.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {args.key}"},
                          timeout=900)  # fmt: skip
    model = client.get("/v1/models").json()["data"][0]["id"]
    out: dict = {"load_avg_start": os.getloadavg()}

    def short_chat() -> float:
        start = time.monotonic()
        r = client.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 4,
            "messages": [{"role": "user", "content": f"hi {secrets.token_hex(2)}"}]})  # fmt: skip
        r.raise_for_status()
        return time.monotonic() - start

    def health() -> float:
        start = time.monotonic()
        client.get("/health")
        return time.monotonic() - start

    out["baseline_short_chat_s"] = sorted(round(short_chat(), 3) for _ in range(5))
    out["baseline_health_s"] = sorted(round(health(), 3) for _ in range(5))
    rss_before = rss_mb(args.pid)
    words = [
        *("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while"),
        *("seven", "wizards", "quietly", "hex", "jovial", "bankers", "near", "old", "mills"),
    ]
    nonce = secrets.token_hex(8)
    text = f"{nonce} " + " ".join(
        words[i % len(words)] + str(i % 97) for i in range(args.tokens // 3)
    )
    count = client.post("/tokenize", json={"model": model, "prompt": text}).json()
    out["prompt_tokens_counted"] = count.get("count")

    stop = threading.Event()
    peak = [rss_before]
    beside: list[float] = []
    health_beside: list[float] = []

    def sampler() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mb(args.pid))
            time.sleep(0.2)

    def chats() -> None:
        time.sleep(2)  # the long prompt is admitted first
        while not stop.is_set():
            beside.append(round(short_chat(), 3))
            health_beside.append(round(health(), 3))

    threads = [threading.Thread(target=sampler), threading.Thread(target=chats)]
    for t in threads:
        t.start()
    start = time.monotonic()
    r = client.post("/v1/completions", json={"model": model, "prompt": text, "max_tokens": 1})
    long_seconds = time.monotonic() - start
    stop.set()
    for t in threads:
        t.join()
    body = r.json()
    out.update({
        "long_status": r.status_code,
        "long_prompt_tokens": body.get("usage", {}).get("prompt_tokens"),
        "long_seconds": round(long_seconds, 1),
        "rss_before_mb": round(rss_before),
        "rss_peak_mb": round(peak[0]),
        "rss_rise_mb": round(peak[0] - rss_before),
        "rss_after_mb": round(rss_mb(args.pid)),
        "short_chats_beside": len(beside),
        "short_chat_beside_s": beside,
        "short_chat_beside_median_s": statistics.median(beside) if beside else None,
        "short_chat_beside_max_s": max(beside) if beside else None,
        "health_beside_max_s": max(health_beside) if health_beside else None,
        "load_avg_end": os.getloadavg(),
    })  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
