"""Hold N partial-header connections open against a local server and measure: /health
latency while they are held, when and how each one is closed (408 or a plain close), and
how much the server's log grew. Loopback only.

    python flood.py --port 8130 --connections 2100 --seconds 20 --log server.log
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import socket
import threading
import time

import httpx


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--connections", type=int, default=2100)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--log", required=True)
    args = p.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    log_before = os.path.getsize(args.log)
    started = time.monotonic()
    sockets: list[socket.socket] = []
    refused = 0
    for _ in range(args.connections):
        try:
            sock = socket.create_connection(("127.0.0.1", args.port), timeout=5)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
            sock.setblocking(False)
            sockets.append(sock)
        except OSError:
            refused += 1
    opened = time.monotonic() - started
    closed_at: dict[int, tuple[float, str]] = {}
    selector = selectors.DefaultSelector()
    for i, sock in enumerate(sockets):
        selector.register(sock, selectors.EVENT_READ, i)
    health: list[float] = []
    statuses: list[int] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            t = time.monotonic()
            try:
                r = httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=5)
                statuses.append(r.status_code)
            except httpx.HTTPError:
                statuses.append(0)
            health.append(time.monotonic() - t)
            time.sleep(0.25)

    prober = threading.Thread(target=probe)
    prober.start()
    deadline = started + args.seconds
    while time.monotonic() < deadline and len(closed_at) < len(sockets):
        for key, _ in selector.select(timeout=0.2):
            sock = key.fileobj
            try:
                data = sock.recv(4096)
            except OSError:
                data = b""
            kind = "408" if data.startswith(b"HTTP/1.1 408") else ("eof" if not data else "other")
            closed_at[key.data] = (time.monotonic() - started, kind)
            selector.unregister(sock)
    stop.set()
    prober.join()
    for sock in sockets:
        sock.close()
    kinds: dict[str, int] = {}
    for _, kind in closed_at.values():
        kinds[kind] = kinds.get(kind, 0) + 1
    result = {
        "connections": args.connections,
        "connect_failures": refused,
        "open_seconds": round(opened, 2),
        "closed_by_server": len(closed_at),
        "still_open_at_end": len(sockets) - len(closed_at),
        "close_kinds": kinds,
        "last_close_s": round(max((t for t, _ in closed_at.values()), default=0), 2),
        "health_probes": len(health),
        "health_statuses": sorted(set(statuses)),
        "health_max_s": round(max(health), 3),
        "health_median_s": round(sorted(health)[len(health) // 2], 3),
        "log_growth_bytes": os.path.getsize(args.log) - log_before,
        "metrics": [
            line
            for line in httpx.get(f"http://127.0.0.1:{args.port}/metrics").text.splitlines()
            if line.startswith(("mtplx_connections_closed_total", "mtplx_open_connections"))
        ],
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
