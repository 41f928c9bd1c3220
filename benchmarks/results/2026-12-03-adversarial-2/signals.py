"""Signals against a server this script starts itself (from the current directory, with
this Python): SIGTERM and SIGINT during a long prompt's prefill and during speculative
decoding of several streams. Each in-flight stream must end with a terminal event
([DONE], an error event) or a closed connection, the process must exit within the
shutdown timeout plus a margin, its log must hold no traceback. Then a second server on
a port already in use must fail fast, clearly, with no traceback, and leave the first one
serving. Prints one JSON object.

    python signals.py --port 8710 --key KEY [--shutdown-timeout 10]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import httpx

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while"]


def start_server(port: int, key: str, shutdown_timeout: float, log: str) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "mtplx",
        "serve",
        "--port",
        str(port),
        "--api-key",
        key,
        "--shutdown-timeout",
        str(shutdown_timeout),
    ]
    with open(log, "w") as f:  # the child keeps its own descriptor
        return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT)


def wait_healthy(port: int, proc: subprocess.Popen, seconds: float = 180) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def stream(port: int, key: str, body: dict, out: dict) -> None:
    """Read one stream to its end; record how it ended."""
    tokens, last = 0, ""
    try:
        with httpx.stream(
            "POST",
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json=body,
            timeout=300,
            headers={"Authorization": f"Bearer {key}"},
        ) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    last = line[:200]
                    if '"content"' in line:
                        tokens += 1
                    if "error" in line and "error" not in out:
                        out["error_event"] = line[:200]
        out["end"] = "[DONE]" if last == "data: [DONE]" else "closed without [DONE]"
    except httpx.HTTPError as exc:
        out["end"] = f"exception {type(exc).__name__}"
    out["chunks"] = tokens


def scenario(args: argparse.Namespace, sig: signal.Signals, phase: str) -> dict:
    log = f"{args.log_dir}/signals-{sig.name}-{phase}.log"
    proc = start_server(args.port, args.key, args.shutdown_timeout, log)
    record: dict = {"signal": sig.name, "phase": phase}
    if not wait_healthy(args.port, proc):
        proc.kill()
        record["error"] = "server did not start"
        return record
    model = httpx.get(
        f"http://127.0.0.1:{args.port}/v1/models", headers={"Authorization": f"Bearer {args.key}"}
    ).json()["data"][0]["id"]
    bodies = []
    if phase == "prefill":
        text = f"{secrets.token_hex(8)} " + " ".join(
            WORDS[i % len(WORDS)] + str(i % 97) for i in range(5000 // 3)
        )
        bodies.append(
            {
                "model": model,
                "stream": True,
                "max_tokens": 32,
                "messages": [{"role": "user", "content": text}],
            }
        )
    else:
        for i in range(4):
            bodies.append(
                {
                    "model": model,
                    "stream": True,
                    "max_tokens": 2000,
                    "temperature": 0,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Write a long story {i}."}],
                }
            )
    streams = [{} for _ in bodies]
    threads = [
        threading.Thread(target=stream, args=(args.port, args.key, b, s))
        for b, s in zip(bodies, streams, strict=True)
    ]
    for t in threads:
        t.start()
    time.sleep(4 if phase == "prefill" else 6)
    record["chunks_before_signal"] = [s.get("chunks", 0) for s in streams]
    sent = time.monotonic()
    proc.send_signal(sig)
    try:
        record["exit_code"] = proc.wait(timeout=args.shutdown_timeout + 60)
    except subprocess.TimeoutExpired:
        record["exit_code"] = None
        proc.kill()
    record["exited_after_s"] = round(time.monotonic() - sent, 1)
    for t in threads:
        t.join(timeout=30)
    record["streams"] = streams
    with open(log) as f:
        text = f.read()
    record["traceback_in_log"] = "Traceback" in text
    record["log_tail"] = text.splitlines()[-4:]
    return record


def second_start(args: argparse.Namespace) -> dict:
    first = start_server(args.port, args.key, args.shutdown_timeout, f"{args.log_dir}/first.log")
    record: dict = {}
    try:
        record["first_healthy"] = wait_healthy(args.port, first)
        log = f"{args.log_dir}/second.log"
        second = start_server(args.port, args.key, args.shutdown_timeout, log)
        start = time.monotonic()
        try:
            record["second_exit_code"] = second.wait(timeout=180)
        except subprocess.TimeoutExpired:
            record["second_exit_code"] = None
            second.kill()
        record["second_exited_after_s"] = round(time.monotonic() - start, 1)
        with open(log) as f:
            text = f.read()
        record["second_traceback"] = "Traceback" in text
        record["second_log_tail"] = text.splitlines()[-4:]
        record["first_still_healthy"] = (
            httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=5).status_code == 200
        )
    finally:
        first.send_signal(signal.SIGTERM)
        record["first_exit_code"] = first.wait(timeout=120)
    return record


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8710)
    p.add_argument("--key", required=True)
    p.add_argument("--shutdown-timeout", type=float, default=10)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--only", default="")
    args = p.parse_args()
    out: dict = {"load_avg_start": os.getloadavg(), "shutdown_timeout": args.shutdown_timeout}
    runs = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        for phase in ("prefill", "decode"):
            if args.only and args.only not in f"{sig.name}-{phase}":
                continue
            runs.append(scenario(args, sig, phase))
            print(json.dumps(runs[-1])[:300], file=sys.stderr)
    out["runs"] = runs
    if not args.only or args.only == "second":
        out["second_start"] = second_start(args)
    out["load_avg_end"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
