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
def live_server(checkpoint: Path | None, log: Path, *args: str) -> Iterator[str]:
    """Serve ``checkpoint`` (None: the shipped default model; with ``args`` for ``mtplx
    serve``) until the block ends; yields the base URL. The server's output goes to ``log``,
    shown when it fails to start."""
    with live_servers(checkpoint, [log], *args) as (url,):
        yield url


@contextmanager
def live_servers(
    checkpoint: Path | None, logs: list[Path], *args: str, healthy_within: float = 60
) -> Iterator[list[str]]:
    """One server per log file, all started at once (they load their models in parallel);
    yields their base URLs once every one answers /health with 200 (each within
    ``healthy_within`` seconds)."""
    processes: list[subprocess.Popen[bytes]] = []
    try:
        urls = []
        for log in logs:
            url, process = _start(checkpoint, log, args)
            processes.append(process)
            urls.append(url)
        for process, url, log in zip(processes, urls, logs, strict=True):
            _wait_healthy(process, url, log, healthy_within)
        yield urls
    finally:
        _stop(processes)


@contextmanager
def live_process(
    checkpoint: Path | None,
    log: Path,
    *args: str,
    launcher: Sequence[str] = (),
    startup_seconds: float = 60,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``live_server`` that also yields the process; ``launcher``: a command the server runs
    under (``mlx.launch ... --``)."""
    url, process = _start(checkpoint, log, args, launcher)
    try:
        _wait_healthy(process, url, log, startup_seconds)
        yield url, process
    finally:
        _stop([process])


def _start(
    checkpoint: Path | None, log: Path, args: Sequence[str], launcher: Sequence[str] = ()
) -> tuple[str, subprocess.Popen[bytes]]:
    # Server settings come from the command line only (MTPLX_HOME, MTPLX_BLAS stay).
    settings = {f"MTPLX_{name.upper()}" for name in ServerSettings.model_fields}
    env = {k: v for k, v in os.environ.items() if k.upper() not in settings}
    env["PYTHONPATH"] = str(ROOT)
    model = [] if checkpoint is None else [str(checkpoint)]
    port = free_port()
    command = [
        *launcher,
        *(sys.executable, "-m", "mtplx", "serve", *model, "--port", str(port), *args),
    ]
    # mlx.launch polls its stdin to forward it to the ranks: at EOF (/dev/null) that loop
    # spins a core, so a launcher gets an open pipe nobody writes to.
    stdin = subprocess.PIPE if launcher else None
    with log.open("w") as output:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdin=stdin, stdout=output, stderr=output
        )
    return f"http://127.0.0.1:{port}", process


def _wait_healthy(
    process: subprocess.Popen[bytes], url: str, log: Path, seconds: float = 60
) -> None:
    deadline = time.monotonic() + seconds
    while True:
        assert process.poll() is None, f"server exited: {log.read_text()[-2000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"not healthy: {log.read_text()[-2000:]}"
        time.sleep(0.1)


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
