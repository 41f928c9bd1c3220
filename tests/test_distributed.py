"""mtplx.distributed: the pipeline's pieces, and ``mtplx serve --distributed`` for real under
``mlx.launch`` (two ranks on the loopback ring) against a single-process server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

import mtplx.distributed as distributed
from mtplx.distributed import (
    HEADER_FIELDS,
    OP_FORWARD,
    ROW_FIELDS,
    Pipeline,
    check_pipeline_model,
    encode_message,
    message_size,
)
from mtplx.models import load
from mtplx.models.slot_layout import SlotRow
from tests.server.live import live_process, live_server

LAUNCH = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "-n", "2", "--"]
PROMPTS = ["Once upon a time", "def fibonacci(n):", "The three primary colors are"]


# -- pieces ---------------------------------------------------------------------------------


def test_encode_message_lays_out_rows_after_the_header():
    rows = [SlotRow(3, 4000, private=True), SlotRow(0, 7)]
    message = encode_message(OP_FORWARD, rows, [4, 1], 256, max_rows=4).tolist()
    assert len(message) == message_size(4) == HEADER_FIELDS + ROW_FIELDS * 4
    assert message[:HEADER_FIELDS] == [OP_FORWARD, 2, 5, 256]
    assert message[HEADER_FIELDS : HEADER_FIELDS + 8] == [3, 4000, 4, 1, 0, 7, 1, 0]
    assert message[HEADER_FIELDS + 8 :] == [0] * 8


def test_only_llama_like_models_are_split(qwen3_next_checkpoint, llama_mtp_checkpoint):
    check_pipeline_model(load(llama_mtp_checkpoint).target)
    with pytest.raises(ValueError, match="llama-like models only, not qwen3_next"):
        check_pipeline_model(load(qwen3_next_checkpoint).target)


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or _is_zombie(pid)


def test_a_lost_pipeline_kills_the_local_ranks_and_terminates_the_launcher(monkeypatch):
    # A stand-in for mlx.launch with two more ranks; one is stopped (SIGSTOP): it ignores
    # the launcher's end and would otherwise outlive everything.
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         "ranks = [subprocess.Popen(['sleep', '300']) for _ in range(2)]\n"
         "print(*(rank.pid for rank in ranks), flush=True)\n"
         "time.sleep(300)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        ranks = [int(pid) for pid in launcher.stdout.readline().split()]
        assert len(ranks) == 2
        os.kill(ranks[0], signal.SIGSTOP)
        assert set(ranks) <= distributed._children(launcher.pid)
        monkeypatch.setattr(distributed, "_launcher_pid", lambda: launcher.pid)

        def exit_(status: int) -> None:
            raise SystemExit(status)

        monkeypatch.setattr(distributed.os, "_exit", exit_)
        with pytest.raises(SystemExit) as exited:
            Pipeline.exit_lost(None)  # type: ignore[arg-type]  # uses no state
        assert exited.value.code == 1
        assert launcher.wait(10) == -signal.SIGTERM
        deadline = time.monotonic() + 10
        while not all(_gone(rank) for rank in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(rank) for rank in ranks)
    finally:
        launcher.kill()
        for rank in ranks:
            with contextlib.suppress(OSError):
                os.kill(rank, signal.SIGKILL)


# -- two ranks under mlx.launch ---------------------------------------------------------------


def _complete(url: str, prompt: str, **options: object) -> dict:
    body = {"model": "fixture", "prompt": prompt, "max_tokens": 24, **options}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _outputs(url: str) -> dict[str, list[str]]:
    """Greedy with MTP drafting at depth 2, greedy plain, and seeded sampling."""
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    configs = {
        "mtp@2": {"temperature": 0, "mtplx": {"drafter": "mtp", "depth": 2}},
        "plain": {"temperature": 0, "mtplx": {"drafter": "none"}},
        "seeded": {"temperature": 0.9, "seed": 11, "mtplx": {"drafter": "mtp", "depth": 2}},
    }
    outputs = {}
    for name, options in configs.items():
        replies = [_complete(url, prompt, model=model, **options) for prompt in PROMPTS]
        outputs[name] = [reply["choices"][0]["text"] for reply in replies]
        if name == "mtp@2":
            assert sum(reply["mtplx"]["drafted"] for reply in replies) > 0
    return outputs


def _rank_pid(port: int, rank: int) -> int:
    """The process of ``rank`` among the servers on ``port``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(port).encode() in command and f"MLX_RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no rank {rank} serving port {port}")


@contextmanager
def _two_ranks(checkpoint: Path, log: Path, *args: str) -> Iterator[tuple[str, object]]:
    with live_process(
        checkpoint, log, "--distributed", *args, launcher=LAUNCH, startup_seconds=180
    ) as (url, process):
        try:
            yield url, process
        finally:
            port = int(url.rsplit(":", 1)[1])
            for rank in (1, 0):  # a stopped rank ignores mlx.launch's SIGTERM
                try:
                    pid = _rank_pid(port, rank)
                except AssertionError:
                    continue
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def one_rank_outputs(llama_mtp_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("one_rank") / "server.log"
    with live_server(llama_mtp_checkpoint, log) as url:
        return _outputs(url)


@pytest.mark.e2e  # two ranks under mlx.launch: `make test-e2e`
def test_two_ranks_match_one_rank_and_stop_cleanly(
    llama_mtp_checkpoint, one_rank_outputs, tmp_path
):
    log = tmp_path / "server.log"
    with _two_ranks(llama_mtp_checkpoint, log) as (url, process):
        assert _outputs(url) == one_rank_outputs
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok"
        port = int(url.rsplit(":", 1)[1])
        os.kill(_rank_pid(port, 0), signal.SIGTERM)  # a normal shutdown stops the worker too
        process.wait(60)
    text = log.read_text()
    assert "exited with code" not in text, text[-3000:]  # mlx.launch warns of non-zero ranks
    assert "rank 1 stopped after" in text


def _stream_until_error(url: str, kill: callable) -> tuple[list[dict], float]:
    """Stream a long completion, call ``kill`` after a few tokens; the events and the
    seconds from ``kill`` to the end of the stream."""
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": 4000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    events, killed_at = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: ") :]))
            if len(events) == 5:
                kill()
                killed_at = time.monotonic()
    assert killed_at is not None, events
    return events, time.monotonic() - killed_at


@pytest.mark.e2e
@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_lost_worker_fails_requests_with_503_and_rank_0_exits_non_zero(
    llama_mtp_checkpoint, tmp_path, fault
):
    log = tmp_path / "server.log"
    with _two_ranks(llama_mtp_checkpoint, log, "--pipeline-timeout", "4") as (url, launcher):
        port = int(url.rsplit(":", 1)[1])
        server, worker = _rank_pid(port, 0), _rank_pid(port, 1)
        kill_signal = signal.SIGKILL if fault == "killed" else signal.SIGSTOP
        events, seconds = _stream_until_error(url, lambda: os.kill(worker, kill_signal))
        assert "error" in events[-1], events[-3:]
        error = events[-1]["error"]
        assert error["type"] == "service_unavailable_error"
        assert "pipeline rank" in error["message"]
        assert seconds < 30
        if fault == "hung":
            assert "has not answered for 4 s" in error["message"]
        # Rank 0 exits 1 and ends mlx.launch too (which would exit 0, or wait forever on a
        # stopped rank): the command the user started fails.
        assert launcher.wait(30) == -signal.SIGTERM
        # Rank 0 signals mlx.launch just before it exits itself: the launcher can end first.
        assert _exits(server, 30)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)


def _is_zombie(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


def _exits(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if _gone(pid):
                return True
        except FileNotFoundError:  # it went between the two reads
            return True
        time.sleep(0.1)
    return False


@pytest.mark.e2e
def test_a_worker_killed_while_idle_is_a_failure_not_a_normal_stop(llama_mtp_checkpoint, tmp_path):
    # mlx.launch SIGTERMs rank 0 as soon as a rank exits non-zero, before any heartbeat
    # notices: the stop that follows must find the worker gone and fail the command.
    log = tmp_path / "server.log"
    with _two_ranks(llama_mtp_checkpoint, log, "--pipeline-timeout", "60") as (url, launcher):
        port = int(url.rsplit(":", 1)[1])
        os.kill(_rank_pid(port, 1), signal.SIGKILL)
        assert launcher.wait(30) == -signal.SIGTERM, log.read_text()[-3000:]


def test_a_worker_that_cannot_load_says_why_and_ends_the_launcher(monkeypatch, caplog):
    group = SimpleNamespace(rank=lambda: 1, size=lambda: 2)
    ended = []
    monkeypatch.setattr(distributed, "_end_launcher", lambda **_: ended.append(True))

    def load(model, stage):
        raise ValueError(f"--distributed splits llama-like models only, not {model}")

    monkeypatch.setattr("mtplx.models.load", load)
    assert Pipeline(group).work("qwen3_next", 16) == 1  # no traceback: one line
    assert ended == [True]
    assert "rank 1: the model failed to load: --distributed splits" in caplog.text
