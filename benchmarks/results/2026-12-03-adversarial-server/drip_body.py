"""One authenticated connection that sends a request head, then its body one byte every
20 s (never idle for ``body_timeout``): when does the server close it? Prints one JSON
object.

    python drip_body.py --port 8130 --key KEY
"""

from __future__ import annotations

import argparse
import json
import socket
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8130)
    p.add_argument("--key", required=True)
    p.add_argument("--seconds", type=float, default=130)
    args = p.parse_args()
    sock = socket.create_connection(("127.0.0.1", args.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100000\r\n"
        + f"Authorization: Bearer {args.key}\r\n\r\n{{".encode()
    )
    start = time.monotonic()
    events = []
    while time.monotonic() - start < args.seconds:
        time.sleep(20)
        try:
            sock.sendall(b" ")
            sock.settimeout(0.5)
            try:
                data = sock.recv(100)
            except TimeoutError:
                events.append(f"open at {time.monotonic() - start:.0f} s")
                continue
            events.append(f"closed at {time.monotonic() - start:.0f} s ({len(data)} bytes)")
            break
        except OSError as exc:
            events.append(f"closed at {time.monotonic() - start:.0f} s ({type(exc).__name__})")
            break
    print(json.dumps({"drip": "1 byte / 20 s", "events": events}, indent=1))


if __name__ == "__main__":
    main()
