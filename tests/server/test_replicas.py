"""Two real ``mtplx serve`` replicas (the shipped default model) behind a real HAProxy that
runs docker/haproxy.cfg, the very file docker/compose.replicas.yaml uses, with the addresses
given through its environment variables.

The bars of the replicas set-up: 16 concurrent streams through the balancer all complete; a
4-turn conversation with one ``X-Session-Id`` lands on one replica, whose prefix cache serves
turns 2-4 while the other replica sees none of it; a replica whose /health answers 503 (its
model still loading) gets no traffic until it is ready. HAProxy comes from Debian
(scripts/install_haproxy.sh, run by ``make test-e2e``); without it these tests fail.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from server.app import create_app
from server.engine_bridge import EngineBridge
from server.settings import ServerSettings
from tests.fake_engine import FakeEngine
from tests.server.live import ROOT, free_port, live_servers

CONFIG = ROOT / "docker" / "haproxy.cfg"
KEY = "replicas-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "mtplx-replica"
SESSION = "X-Session-Id"
CHAT = "/v1/chat/completions"
STREAMS = 16

pytestmark = pytest.mark.e2e  # live processes (two replicas, HAProxy): `make test-e2e`


def haproxy() -> str:
    """The haproxy binary (Debian puts it in /usr/sbin, which a user's PATH may lack)."""
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        pytest.fail("haproxy is needed: `make test-e2e` installs it (scripts/install_haproxy.sh)")
    return found


@dataclass(frozen=True)
class Balancer:
    url: str
    stats: str

    def servers(self) -> dict[str, dict[str, str]]:
        """HAProxy's view of the affinity backend's servers (the leastconn backend tracks
        them): status (UP, DOWN, "UP 1/2" ...) and the last check's result."""
        text = httpx.get(f"{self.stats}/stats;csv").text.removeprefix("# ")
        return {
            row["svname"]: row
            for row in csv.DictReader(io.StringIO(text))
            if row["pxname"] == "affinity" and row["svname"] != "BACKEND"
        }

    def wait_for(self, states: dict[str, str]) -> None:
        """Until each server has the given status after a check of its own (not the state
        HAProxy assumes before the first check)."""
        deadline = time.monotonic() + 60
        while True:
            servers = self.servers()
            seen = {name: (row["status"], row["check_status"]) for name, row in servers.items()}
            checked = {"UP": "L7OK", "DOWN": "L7STS"}
            if all(seen[name] == (state, checked[state]) for name, state in states.items()):
                return
            assert time.monotonic() < deadline, f"balancer sees {seen}, not {states}"
            time.sleep(0.2)


@contextmanager
def balancer(replicas: list[str], log: Path) -> Iterator[Balancer]:
    """A real haproxy on docker/haproxy.cfg in front of ``replicas`` (two base URLs)."""
    port, stats = free_port(), free_port()
    env = {
        **os.environ,
        "MTPLX_LB_BIND": f"127.0.0.1:{port}",
        "MTPLX_LB_STATS_BIND": f"127.0.0.1:{stats}",
        "MTPLX_REPLICA_1": replicas[0].removeprefix("http://"),
        "MTPLX_REPLICA_2": replicas[1].removeprefix("http://"),
    }
    command = [haproxy(), "-f", str(CONFIG)]
    checked = subprocess.run([*command, "-c"], env=env, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with log.open("w") as output:
        process = subprocess.Popen([*command, "-db"], env=env, stdout=output, stderr=output)
    try:
        result = Balancer(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{stats}")
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, log.read_text()
            try:
                result.servers()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
        yield result
    finally:
        process.terminate()
        process.wait(10)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A replica's /metrics: (sample name, sorted labels) -> value."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def chat_requests(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    """Chat completions the replica answered, any status."""
    return sum(
        value
        for (name, labels), value in metrics.items()
        if name == "mtplx_requests_total" and ("endpoint", CHAT) in labels
    )


def sample(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return metrics.get((name, ()), 0.0)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("replicas")


@pytest.fixture(scope="module")
def replicas(logs: Path) -> Iterator[list[str]]:
    """Two replicas as the compose file runs them (the CPU preset, a key, queue 16)."""
    args = ["--config", str(ROOT / "configs" / "cpu-small.yaml"), "--api-key", KEY]
    args += ["--max-queue", "16", "--served-model-name", MODEL, "--log-level", "warning"]
    # The default model's servers calibrate their step costs at start-up unless this machine
    # has them cached (a new head or checkout changes the key): two at once on 2 cores take
    # minutes.
    replica_logs = [logs / "replica1.log", logs / "replica2.log"]
    with live_servers(None, replica_logs, *args, healthy_within=600) as urls:
        yield urls


@pytest.fixture(scope="module")
def lb(replicas: list[str], logs: Path) -> Iterator[Balancer]:
    with balancer(replicas, logs / "haproxy.log") as result:
        result.wait_for({"replica1": "UP", "replica2": "UP"})
        yield result


def _stream(client: httpx.Client, url: str, index: int) -> tuple[str, list[dict[str, Any]]]:
    """One streamed chat completion; even-numbered ones carry a session header. Returns the
    replica that answered and the chunks (the stream must end with [DONE])."""
    headers = dict(AUTH)
    if index % 2 == 0:
        headers[SESSION] = f"stream-{index}"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Count from {index} to {index + 20}."}],
        "max_tokens": 8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", f"{url}{CHAT}", json=body, headers=headers) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        replica = response.headers["x-mtplx-replica"]
    assert lines[-1] == "data: [DONE]"
    return replica, [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_sixteen_concurrent_streams_through_the_balancer_all_complete(
    lb: Balancer, replicas: list[str]
) -> None:
    before = [chat_requests(scrape(url)) for url in replicas]
    started = time.monotonic()
    with (
        httpx.Client(timeout=300, limits=httpx.Limits(max_connections=STREAMS)) as client,
        ThreadPoolExecutor(STREAMS) as pool,
    ):
        results = list(pool.map(lambda i: _stream(client, lb.url, i), range(STREAMS)))
    seconds = time.monotonic() - started
    print(f"\n{STREAMS} concurrent streams through the balancer: {seconds:.1f} s")
    for _, chunks in results:
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finish[-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 8
    served = [replica for replica, _ in results]
    print(f"per replica: {sorted((name, served.count(name)) for name in set(served))}")
    assert set(served) == {"replica1", "replica2"}  # both replicas took a share
    # Each replica's own counters agree with the balancer's header.
    after = [chat_requests(scrape(url)) for url in replicas]
    for name, old, new in zip(("replica1", "replica2"), before, after, strict=True):
        assert new - old == served.count(name)


def _rest_of(lines: Iterator[str], limit: int = 20) -> list[str]:
    """The stream's last lines (at most ``limit`` kept): its finish reason or error."""
    kept: list[str] = []
    for line in lines:
        if line:
            kept = [*kept[-(limit - 1) :], line]
    return kept


def _requests_by_status(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict:
    return {
        labels: value for (name, labels), value in metrics.items() if name == "mtplx_requests_total"
    }


def _log_tail(logs: Path, replica: str, replicas: list[str], lines: int = 40) -> str:
    log = logs / f"replica{replicas.index(replica) + 1}.log"
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def test_a_stream_passes_through_unbuffered(lb: Balancer, replicas: list[str], logs: Path) -> None:
    """The first chunk reaches the client while its replica is still generating."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        # Far more than it waits for: the stream is closed after its first text, and on a
        # loaded machine this client may be descheduled for seconds while the replica runs.
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {**AUTH, SESSION: "unbuffered"}
    with httpx.stream("POST", f"{lb.url}{CHAT}", json=body, headers=headers, timeout=300) as reply:
        assert reply.status_code == 200
        replica = replicas[int(reply.headers["x-mtplx-replica"].removeprefix("replica")) - 1]
        before = chat_requests(scrape(replica))
        lines = reply.iter_lines()  # one iterator: httpx streams a body once
        for line in lines:  # up to the first generated text
            if line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                if chunk["choices"][0]["delta"].get("content"):
                    break
        metrics = scrape(replica)
        running = sample(metrics, "mtplx_requests_running")
        ending = [] if running == 1 else _rest_of(lines)
    # Still generating when its first text came through (if not: how the stream ended, and
    # what the replica counted and logged, so that a failure explains itself).
    assert running == 1, (ending, _requests_by_status(metrics), _log_tail(logs, replica, replicas))
    # Closing the stream cancels it on the replica (through the balancer); wait for that, so
    # that the next test's counters do not see it.
    deadline = time.monotonic() + 60
    while chat_requests(metrics := scrape(replica)) == before or sample(
        metrics, "mtplx_requests_running"
    ):
        assert time.monotonic() < deadline, "the replica did not notice the closed stream"
        time.sleep(0.1)


def test_a_conversation_stays_on_one_replica_and_hits_its_prefix_cache(
    lb: Balancer, replicas: list[str]
) -> None:
    # What a client does: one header per conversation (the openai SDK's default_headers, or
    # extra_headers per call).
    client = openai.OpenAI(
        base_url=f"{lb.url}/v1",
        api_key=KEY,
        default_headers={SESSION: "conversation-7f3a"},
        max_retries=0,
        timeout=300,
    )
    before = [scrape(url) for url in replicas]
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a terse assistant for a hardware shop. " * 4}
    ]
    served: list[str] = []
    prompt_tokens: list[int] = []
    for question in ("Do you sell hammers?", "How heavy?", "Any in red?", "Price of two?"):
        messages.append({"role": "user", "content": question})
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0
        )
        reply = raw.parse()
        served.append(raw.headers["x-mtplx-replica"])
        prompt_tokens.append(reply.usage.prompt_tokens)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    after = [scrape(url) for url in replicas]

    assert len(set(served)) == 1, served
    home = int(served[0].removeprefix("replica")) - 1
    other = 1 - home

    def delta(i: int, name: str) -> float:
        return sample(after[i], name) - sample(before[i], name)

    assert chat_requests(after[home]) - chat_requests(before[home]) == 4
    # Turns 2-4 found the conversation so far in this replica's prefix cache: at least the
    # previous turn's whole prompt, in whole 16-token blocks.
    assert delta(home, "mtplx_prefix_cache_hits_total") >= 3
    floor = sum(tokens // 16 * 16 for tokens in prompt_tokens[:-1])
    hit_tokens = delta(home, "mtplx_prefix_cache_hit_tokens_total")
    print(f"\nturns on {served[0]}; prompt tokens {prompt_tokens}; hit tokens {hit_tokens:.0f}")
    assert hit_tokens >= floor
    # The other replica saw none of it.
    assert chat_requests(after[other]) == chat_requests(before[other])
    for name in ("hits", "misses", "hit_tokens"):
        assert delta(other, f"mtplx_prefix_cache_{name}_total") == 0


@contextmanager
def loading_replica() -> Iterator[tuple[str, threading.Event]]:
    """The real app in a thread, its engine 'loading' (the factory waits) until the event is
    set; then a FakeEngine serves. Yields the base URL and the event."""
    gate = threading.Event()

    def factory() -> FakeEngine:
        gate.wait()
        return FakeEngine()

    settings = ServerSettings(api_key=KEY, served_model_name=MODEL)
    app = create_app(EngineBridge(factory), settings)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="loading-replica", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.05)
        yield url, gate
    finally:
        gate.set()
        server.should_exit = True
        thread.join(30)


def test_a_replica_that_is_not_ready_gets_no_traffic(replicas: list[str], logs: Path) -> None:
    with (
        loading_replica() as (loading, gate),
        balancer([replicas[0], loading], logs / "haproxy-loading.log") as lb,
    ):
        assert httpx.get(f"{loading}/health").status_code == 503
        lb.wait_for({"replica1": "UP", "replica2": "DOWN"})
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        sessions = [f"user-{i}" for i in range(8)]

        def send(session: str | None) -> str:
            headers = {**AUTH, SESSION: session} if session else AUTH
            reply = httpx.post(f"{lb.url}{CHAT}", json=body, headers=headers, timeout=300)
            assert reply.status_code == 200, reply.text
            return reply.headers["x-mtplx-replica"]

        assert {send(s) for s in [*sessions, None, None]} == {"replica1"}
        assert chat_requests(scrape(loading)) == 0  # not even one that was retried elsewhere

        gate.set()  # the model has loaded: /health turns 200 and traffic comes
        lb.wait_for({"replica1": "UP", "replica2": "UP"})
        assert {send(s) for s in sessions} == {"replica1", "replica2"}
        assert chat_requests(scrape(loading)) > 0
