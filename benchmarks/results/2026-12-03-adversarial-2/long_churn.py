"""Long prompts in stores of their own, cancelled at every stage, beside short streams.

Each cycle sends several 3,000-6,000-token prompts at once (a nonce first, so the prefix
cache cannot serve them): one cut by its client mid-prefill, one cut after its first tokens
(mid-decode), one whose connection closes right after the request is sent (before its
first forward), the rest run to the end. Short greedy streams run beside them the whole
time; their longest gap between two chunks is recorded. After each cycle: the batch must
empty, RSS and /metrics are sampled. Before and after everything a fixed greedy chat must
give the same text (and, with ``--ref-port``, the same text as another server). Prints one
JSON object.

    python long_churn.py --port 8701 --key KEY --pid SERVER_PID [--ref-port 8702]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import socket
import threading
import time

import httpx

WORDS = [
    *("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while"),
    *("seven", "wizards", "quietly", "hex", "jovial", "bankers", "near", "old", "mills"),
]
FIXED = [{"role": "user", "content": "Name three rivers of Europe and one fact about each."}]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def long_text(tokens: int) -> str:
    """About ``tokens`` tokens (each word+number is ~3), a fresh nonce first."""
    return f"{secrets.token_hex(8)} " + " ".join(
        WORDS[i % len(WORDS)] + str(i % 97) for i in range(tokens // 3)
    )


def metrics(client: httpx.Client) -> dict[str, float]:
    """The /metrics samples worth watching (statuses, running, KV if exported)."""
    out: dict[str, float] = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        if (
            "kv" in name
            or name.startswith("mtplx_requests_total")
            or name in ("mtplx_sequences_running", "mtplx_requests_running")
        ):
            out[name] = float(value)
    return out


def greedy(url: str, key: str, model: str) -> str:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "messages": FIXED, "max_tokens": 48, "temperature": 0},
        timeout=600,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def stream_chat(url: str, key: str, body: dict, cut: str | None, out: dict) -> None:
    """Stream one chat; ``cut``: None (to the end), 'prefill' (close after 1.5 s with no
    token yet), 'decode' (close after the third content chunk). Records gaps."""
    start = time.monotonic()
    last = None
    gaps: list[float] = []
    chunks = 0
    try:
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json=body,
            timeout=900,
            headers={"Authorization": f"Bearer {key}"},
        ) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                now = time.monotonic()
                if cut == "prefill" and now - start > 1.5 and chunks == 0:
                    out["cut_at_s"] = round(now - start, 2)
                    break
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    out["error"] = data["error"]
                    continue
                delta = data["choices"][0]["delta"] if data.get("choices") else {}
                if delta.get("content"):
                    chunks += 1
                    if last is None:
                        out["ttft_s"] = round(now - start, 3)
                    else:
                        gaps.append(now - last)
                    last = now
                if cut == "decode" and chunks >= 3:
                    out["cut_at_s"] = round(now - start, 2)
                    break
    except httpx.HTTPError as exc:
        out["exception"] = type(exc).__name__
    out["chunks"] = chunks
    out["max_gap_s"] = round(max(gaps), 3) if gaps else None
    out["total_s"] = round(time.monotonic() - start, 2)


def cut_before_forward(port: int, key: str, body: dict, out: dict) -> None:
    """Send the whole request on a raw socket and close at once (50 ms)."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head + data)
        time.sleep(0.05)
    out["closed_after_s"] = 0.05


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8701)
    p.add_argument("--key", required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--ref-port", type=int, default=0)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--lengths", default="3000,4500,6000,5000,3500")
    p.add_argument("--shorts", type=int, default=3)
    args = p.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    client = httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {args.key}"}, timeout=900
    )
    model = client.get("/v1/models").json()["data"][0]["id"]
    out: dict = {"load_avg_start": os.getloadavg(), "rss_start_mb": rss_mb(args.pid)}
    out["greedy_before"] = greedy(url, args.key, model)
    if args.ref_port:
        out["greedy_ref"] = greedy(f"http://127.0.0.1:{args.ref_port}", args.key, model)
    out["metrics_start"] = metrics(client)
    lengths = [int(n) for n in args.lengths.split(",")]
    cuts = ["prefill", "decode", "before", None, None, None, None, None]
    out["cycles"] = []
    for cycle in range(args.cycles):
        record: dict = {"load_avg": os.getloadavg(), "rss_before_mb": rss_mb(args.pid)}
        stop = threading.Event()
        peak = [record["rss_before_mb"]]
        health: list[float] = []
        running_seen: list[int] = []

        def sampler(stop=stop, peak=peak, running_seen=running_seen, health=health) -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], rss_mb(args.pid))
                t = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    h = client.get("/health", timeout=30).json()
                    running_seen.append(h["batch"]["running"])
                health.append(time.monotonic() - t)
                time.sleep(0.25)

        shorts: list[dict] = []

        def short_loop(stop=stop, shorts=shorts) -> None:
            while not stop.is_set():
                result: dict = {}
                body = {
                    "model": model,
                    "stream": True,
                    "max_tokens": 48,
                    "temperature": 0,
                    "messages": [
                        {"role": "user", "content": f"Count to ten. {secrets.token_hex(2)}"}
                    ],
                }
                stream_chat(url, args.key, body, None, result)
                shorts.append(result)

        longs: list[dict] = [{"tokens": n, "cut": cuts[i]} for i, n in enumerate(lengths)]
        threads = [threading.Thread(target=sampler)]
        threads += [threading.Thread(target=short_loop) for _ in range(args.shorts)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        long_threads = []
        for item in longs:
            body = {
                "model": model,
                "stream": True,
                "max_tokens": 24,
                "temperature": 0,
                "messages": [{"role": "user", "content": long_text(item["tokens"])}],
            }
            if item["cut"] == "before":
                target, targs = cut_before_forward, (args.port, args.key, body, item)
            else:
                target, targs = stream_chat, (url, args.key, body, item["cut"], item)
            long_threads.append(threading.Thread(target=target, args=targs))
        started = time.monotonic()
        for t in long_threads:
            t.start()
        for t in long_threads:
            t.join()
        record["longs_s"] = round(time.monotonic() - started, 1)
        stop.set()
        for t in threads:
            t.join()
        # The batch must empty once every client is gone.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            h = client.get("/health").json()
            if h["batch"]["running"] == 0 and h["batch"]["waiting"] == 0:
                break
            time.sleep(0.5)
        record["drained_after_s"] = round(time.monotonic() - started, 1)
        record["health_after"] = h["batch"]
        time.sleep(2)
        record["longs"] = longs
        record["shorts"] = {
            "count": len(shorts),
            "statuses": sorted({s.get("status", 0) for s in shorts}),
            "errors": [s for s in shorts if "error" in s or "exception" in s][:3],
            "max_gap_s": max((s["max_gap_s"] or 0) for s in shorts) if shorts else None,
            "gaps_over_1s": sum(1 for s in shorts if (s["max_gap_s"] or 0) > 1.0),
            "max_ttft_s": max((s.get("ttft_s") or 0) for s in shorts) if shorts else None,
        }
        record["health_max_s"] = round(max(health), 3) if health else None
        record["max_running_seen"] = max(running_seen) if running_seen else None
        record["rss_peak_mb"] = peak[0]
        record["rss_after_mb"] = rss_mb(args.pid)
        record["metrics_after"] = metrics(client)
        out["cycles"].append(record)
        print(
            json.dumps({"cycle": cycle, "rss_after_mb": record["rss_after_mb"]}),
            file=__import__("sys").stderr,
        )
    out["greedy_after"] = greedy(url, args.key, model)
    out["greedy_same"] = out["greedy_after"] == out["greedy_before"]
    if args.ref_port:
        out["greedy_same_as_ref"] = out["greedy_after"] == out["greedy_ref"]
    out["rss_end_mb"] = rss_mb(args.pid)
    out["load_avg_end"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
