"""Can N long prompts at once pass ``max_kv_bytes``? Sends N prompts of ``--tokens``
tokens (nonce first) together, ``max_tokens`` 1, to a server started with a small
``--max-kv-bytes``, and samples /health's running count and the server's RSS every 0.2 s.
With the bound honoured, no more run at once than the bound holds (one alone always
runs). Prints one JSON object.

    python kv_burst.py --port 8703 --key KEY --pid SERVER_PID --count 4 --tokens 2500
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import threading
import time

import httpx

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while"]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8703)
    p.add_argument("--key", required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2500)
    args = p.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    headers = {"Authorization": f"Bearer {args.key}"}
    model = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
    out: dict = {"load_avg_start": os.getloadavg(), "rss_before_mb": rss_mb(args.pid)}
    stop = threading.Event()
    running: list[int] = []
    peak = [out["rss_before_mb"]]

    def sampler() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mb(args.pid))
            with contextlib.suppress(httpx.HTTPError):
                running.append(httpx.get(f"{url}/health", timeout=30).json()["batch"]["running"])
            time.sleep(0.2)

    results: list[dict] = []

    def one(index: int) -> None:
        text = f"{secrets.token_hex(8)} " + " ".join(
            WORDS[i % len(WORDS)] + str(i % 97) for i in range(args.tokens // 3)
        )
        start = time.monotonic()
        r = httpx.post(
            f"{url}/v1/chat/completions",
            headers=headers,
            timeout=1800,
            json={
                "model": model,
                "max_tokens": 1,
                "temperature": 0,
                "messages": [{"role": "user", "content": text}],
            },
        )
        body = r.json()
        results.append(
            {
                "index": index,
                "status": r.status_code,
                "prompt_tokens": body.get("usage", {}).get("prompt_tokens"),
                "seconds": round(time.monotonic() - start, 1),
            }
        )

    watcher = threading.Thread(target=sampler)
    watcher.start()
    time.sleep(0.5)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    out.update(
        results=sorted(results, key=lambda r: r["seconds"]),
        max_running=max(running),
        rss_peak_mb=peak[0],
        rss_after_mb=rss_mb(args.pid),
        load_avg_end=os.getloadavg(),
    )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
