"""``python -m mtplx serve`` in a subprocess for live tests: a free port, settings from the
command line only, and a wait until /health answers 200."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
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
def live_server(checkpoint: Path, log: Path, *args: str) -> Iterator[str]:
    """Serve ``checkpoint`` (with ``args`` for ``mtplx serve``) until the block ends; yields
    the base URL. The server's output goes to ``log``, shown when it fails to start."""
    with live_process(checkpoint, log, *args) as (url, _):
        yield url


@contextmanager
def live_process(
    checkpoint: Path,
    log: Path,
    *args: str,
    launcher: Sequence[str] = (),
    startup_seconds: float = 60,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``live_server`` that also yields the process; ``launcher``: a command the server runs
    under (``mlx.launch ... --``)."""
    # Server settings come from the command line only (MTPLX_HOME, MTPLX_BLAS stay).
    settings = {f"MTPLX_{name.upper()}" for name in ServerSettings.model_fields}
    env = {k: v for k, v in os.environ.items() if k.upper() not in settings}
    env["PYTHONPATH"] = str(ROOT)
    port = free_port()
    command = [
        *launcher,
        *(sys.executable, "-m", "mtplx", "serve", str(checkpoint), "--port", str(port), *args),
    ]
    # mlx.launch polls its stdin to forward it to the ranks: at EOF (/dev/null) that loop
    # spins a core, so a launcher gets an open pipe nobody writes to.
    stdin = subprocess.PIPE if launcher else None
    with log.open("w") as output:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdin=stdin, stdout=output, stderr=output
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_seconds
        while True:
            assert process.poll() is None, f"server exited: {log.read_text()[-2000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"not healthy: {log.read_text()[-2000:]}"
            time.sleep(0.1)
        yield url, process
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
