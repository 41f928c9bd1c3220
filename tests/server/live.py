"""``python -m mtplx serve`` in a subprocess for live tests: a free port, settings from the
command line only, and a wait until /health answers 200."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from server.settings import ServerSettings

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def live_server(checkpoint: Path | None, log: Path, *args: str) -> Iterator[str]:
    """Serve ``checkpoint`` (None: the shipped default model; with ``args`` for ``mtplx
    serve``) until the block ends; yields the base URL. The server's output goes to ``log``,
    shown when it fails to start."""
    with live_servers(checkpoint, [log], *args) as (url,):
        yield url


@contextmanager
def live_servers(checkpoint: Path | None, logs: list[Path], *args: str) -> Iterator[list[str]]:
    """One server per log file, all started at once (they load their models in parallel);
    yields their base URLs once every one answers /health with 200."""
    # Server settings come from the command line only (MTPLX_HOME, MTPLX_BLAS stay).
    settings = {f"MTPLX_{name.upper()}" for name in ServerSettings.model_fields}
    env = {k: v for k, v in os.environ.items() if k.upper() not in settings}
    env["PYTHONPATH"] = str(ROOT)
    model = [] if checkpoint is None else [str(checkpoint)]
    processes: list[subprocess.Popen[bytes]] = []
    urls: list[str] = []
    try:
        for log in logs:
            port = free_port()
            command = [sys.executable, "-m", "mtplx", "serve", *model, "--port", str(port), *args]
            with log.open("w") as output:
                processes.append(
                    subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=output)
                )
            urls.append(f"http://127.0.0.1:{port}")
        for process, url, log in zip(processes, urls, logs, strict=True):
            _wait_healthy(process, url, log)
        yield urls
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


def _wait_healthy(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, f"server exited: {log.read_text()[-2000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"not healthy: {log.read_text()[-2000:]}"
        time.sleep(0.1)
