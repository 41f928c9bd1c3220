"""Two streams in flight, then SIGINT twice: how each stream ends and how long the server
took to exit. The server's pid and exit-status file are given (loopback only).

    python double_sigint.py --port 8123 --key KEY --pid PID --rc-file FILE
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import httpx


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--key", required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--rc-file", required=True)
    args = p.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    headers = {"Authorization": f"Bearer {args.key}"}
    model = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
    endings: list[list[str]] = []
    started = [threading.Event(), threading.Event()]

    def stream(event: threading.Event) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "Tell a story."}],
                "max_tokens": 4000, "stream": True, "ignore_eos": True}  # fmt: skip
        payloads: list[str] = []
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                              headers=headers, timeout=120) as response:  # fmt: skip
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        payloads.append(line[6:])
                        event.set()
        except httpx.HTTPError as exc:
            payloads.append(f"transport error: {type(exc).__name__}")
        endings.append(payloads[-2:])

    threads = [threading.Thread(target=stream, args=(event,)) for event in started]
    for thread in threads:
        thread.start()
    for event in started:
        event.wait(60)
    t0 = time.monotonic()
    os.kill(args.pid, signal.SIGINT)
    time.sleep(0.5)
    os.kill(args.pid, signal.SIGINT)
    for thread in threads:
        thread.join(60)
    while not os.path.exists(args.rc_file) and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    exited = round(time.monotonic() - t0, 2)
    with open(args.rc_file) as f:
        rc = int(f.read().strip())
    result = {
        "exit_status": rc,
        "exit_after_first_sigint_s": exited,
        "stream_endings": [
            [
                json.loads(p).get("error", {}).get("code", "chunk") if p.startswith("{") else p
                for p in ending
            ]
            for ending in endings
        ],
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
