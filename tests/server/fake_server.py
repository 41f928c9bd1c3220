"""Test-only launcher: the real app around the fake engine, served by uvicorn on a socket it
binds itself (port 0), printing ``PORT <n>`` once listening. Tests run it as a subprocess
(``python -m tests.server.fake_server``) to drive a real HTTP server with real clients; the
lead swaps FakeEngine for the real engine on a tiny fixture checkpoint here, nowhere else.
"""

from __future__ import annotations

import argparse
import socket
import sys

import uvicorn

from server.app import create_app
from server.settings import ServerSettings
from tests.fake_engine import FakeEngine


def main() -> None:
    """Parse options, bind, announce the port, serve until terminated."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--api-key")
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    settings = ServerSettings(api_key=args.api_key)
    app = create_app(FakeEngine(token_delay=args.token_delay), settings)
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])
    sys.exit(0)


if __name__ == "__main__":
    main()
