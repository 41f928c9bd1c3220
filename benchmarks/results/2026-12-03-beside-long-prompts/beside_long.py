"""Short greedy streams beside several long prompts prefilling at once.

Sends ``--lengths`` long prompts at once (a nonce first, so the prefix cache cannot serve
them; all run to the end) while ``--shorts`` workers keep short greedy streams going, one
after another, from a second before the long prompts until they have all answered. Records
each short stream's longest gap between two content chunks and first-token time, each long
prompt's first-token time, and the load average. Prints one JSON object.

Reuses the adversarial pass's helpers (``../2026-12-03-adversarial-2/long_churn.py``).

    python beside_long.py --port 8731 --key KEY [--lengths 3000,4000,4500,5000] [--shorts 3]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "2026-12-03-adversarial-2"))
from long_churn import long_text, stream_chat


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8731)
    p.add_argument("--key", required=True)
    p.add_argument("--lengths", default="3000,4000,4500,5000")
    p.add_argument("--shorts", type=int, default=3)
    args = p.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    headers = {"Authorization": f"Bearer {args.key}"}
    model = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
    out: dict = {"load_avg_start": os.getloadavg(), "cpu_start": time.process_time()}
    stop = threading.Event()
    shorts: list[dict] = []

    def short_loop() -> None:
        while not stop.is_set():
            result: dict = {}
            body = {
                "model": model, "stream": True, "max_tokens": 48, "temperature": 0,
                "messages": [{"role": "user", "content": f"Count to ten. {secrets.token_hex(2)}"}],
            }  # fmt: skip
            stream_chat(url, args.key, body, None, result)
            shorts.append(result)

    workers = [threading.Thread(target=short_loop) for _ in range(args.shorts)]
    for t in workers:
        t.start()
    time.sleep(1.0)
    longs = [{"tokens": int(n)} for n in args.lengths.split(",")]
    threads = []
    for item in longs:
        body = {
            "model": model, "stream": True, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": long_text(item["tokens"])}],
        }  # fmt: skip
        threads.append(threading.Thread(target=stream_chat, args=(url, args.key, body, None, item)))
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["longs_s"] = round(time.monotonic() - started, 1)
    stop.set()
    for t in workers:
        t.join()
    gaps = sorted((s["max_gap_s"] or 0) for s in shorts)
    out["longs"] = longs
    out["shorts"] = {
        "count": len(shorts),
        "statuses": sorted({s.get("status", 0) for s in shorts}),
        "errors": [s for s in shorts if "error" in s or "exception" in s][:3],
        "max_gap_s": gaps[-1] if gaps else None,
        "median_max_gap_s": gaps[len(gaps) // 2] if gaps else None,
        "max_gaps_s": gaps,
        "gaps_over_1s": sum(1 for g in gaps if g > 1.0),
        "max_ttft_s": max((s.get("ttft_s") or 0) for s in shorts) if shorts else None,
    }
    out["load_avg_end"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
