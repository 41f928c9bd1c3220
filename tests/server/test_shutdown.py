"""Graceful shutdown of ``mtplx serve``: SIGTERM with streams in flight lets short ones
finish, ends the rest with an error event, every stream ends with ``[DONE]``, exit 0; a
second SIGINT ends every stream at once with that error event and exits 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.settings import ServerSettings
from tests.server.live import ROOT, free_port


def _start(checkpoint: Path, log: Path, shutdown_timeout: float) -> tuple[subprocess.Popen, str]:
    settings = {f"MTPLX_{name.upper()}" for name in ServerSettings.model_fields}
    env = {k: v for k, v in os.environ.items() if k.upper() not in settings}
    env["PYTHONPATH"] = str(ROOT)
    port = free_port()
    command = [
        sys.executable, "-m", "mtplx", "serve", str(checkpoint), "--port", str(port),
        "--drafter", "ngram", "--served-model-name", "tiny", "--log-level", "warning",
        "--shutdown-timeout", str(shutdown_timeout),
    ]  # fmt: skip
    with log.open("w") as output:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=output)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, log.read_text()[-2000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.1)


def _stream(url: str, max_tokens: int, out: list, started: threading.Event) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"go {max_tokens}"}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    payloads = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                payloads.append(line[6:])
                started.set()
    out.append(payloads)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_streams_and_exits_zero(
    tiny_checkpoint: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    process, url = _start(tiny_checkpoint, tmp_path / "server.log", shutdown_timeout=1.5)
    try:
        results: list[list[str]] = []
        started = [threading.Event() for _ in range(3)]
        threads = [
            threading.Thread(target=_stream, args=(url, tokens, results, event))
            for tokens, event in zip((20, 4000, 4000), started, strict=True)
        ]
        for thread in threads:
            thread.start()
        for event in started:  # every stream is under way (the short one may have ended)
            assert event.wait(30)
        process.send_signal(sig)
        for thread in threads:
            thread.join(30)
        assert process.wait(30) == 0, (tmp_path / "server.log").read_text()[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
    assert len(results) == 3
    endings = []
    for payloads in results:
        assert payloads[-1] == "[DONE]"
        last = json.loads(payloads[-2])
        if "error" in last:
            assert last["error"]["code"] == "server_shutting_down"
            endings.append("error")
        else:
            assert last["choices"][0]["finish_reason"] == "length"
            endings.append("finish")
    assert sorted(endings) == ["error", "error", "finish"]


def test_second_sigint_ends_streams_with_an_error_event_and_exits_non_zero(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    process, url = _start(tiny_checkpoint, log, shutdown_timeout=60)
    try:
        results: list[list[str]] = []
        started = [threading.Event() for _ in range(2)]
        threads = [
            threading.Thread(target=_stream, args=(url, 4000, results, event)) for event in started
        ]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(30)
        process.send_signal(signal.SIGINT)
        time.sleep(0.5)  # the first one starts the graceful drain
        process.send_signal(signal.SIGINT)
        for thread in threads:
            thread.join(30)
        assert process.wait(30) == 130, log.read_text()[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
    assert len(results) == 2
    for payloads in results:
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["error"]["code"] == "server_shutting_down"
    assert "interrupted twice" in log.read_text() and "Traceback" not in log.read_text()


# ``mtplx serve`` whose start-up calibration goes on until the process ends: measuring the
# tiny checkpoint's step costs takes well under a second, too short to be sure a signal
# lands inside it. A calibration another test cached for the same checkpoint is not read, so
# the start always measures.
_ENDLESS_CALIBRATION = """
import sys
from mtplx import calibration
measure = calibration.calibrate
calibration._read_cache = lambda engine, path: None

def endless(engine, rounds=3):
    while True:
        measure(engine, rounds=1)

calibration.calibrate = endless
sys.argv[0] = "mtplx"
from mtplx.cli import run
run()
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_calibrating_exits_at_once_and_caches_nothing(
    tiny_checkpoint: Path, tmp_path: Path, calibration_cache: Path, sig: signal.Signals
) -> None:
    settings = {f"MTPLX_{name.upper()}" for name in ServerSettings.model_fields}
    env = {k: v for k, v in os.environ.items() if k.upper() not in settings}
    env["PYTHONPATH"] = str(ROOT)
    cached = set(calibration_cache.glob("*"))
    log = tmp_path / "server.log"
    command = [
        sys.executable, "-c", _ENDLESS_CALIBRATION, "serve", str(tiny_checkpoint),
        "--port", str(free_port()), "--log-level", "info",
    ]  # fmt: skip
    with log.open("w") as output:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=output)
    try:
        deadline = time.monotonic() + 120
        while "measuring the step costs" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        time.sleep(0.5)  # inside the steps
        process.send_signal(sig)
        # A model still loading cannot be interrupted, but the process does not wait for it.
        assert process.wait(30) == 0, log.read_text()[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
    assert "Traceback" not in log.read_text()
    assert set(calibration_cache.glob("*")) <= cached  # no file, whole or half
