#!/usr/bin/env python3
"""``make test-docker``: build the image and check it for real (standard library only).

Starts dockerd when none answers (root only), picks the base image (``BASE_IMAGE``; by default
python:3.11-slim, or, when that cannot be pulled, a stand-in built from Debian packages by
docker/make_base.sh), builds docker/Dockerfile, then runs two containers published on
127.0.0.1 only and checks: /health becomes 200 and Docker reports "healthy", the process is
not root, 401 without the API key, a chat completion, a streamed chat completion ending with
``data: [DONE]``, a clean ``docker stop``; and the same image under ``--read-only --tmpfs
/tmp:exec --user 12345:12345``. Every wait is bounded. Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BASE = "python:3.11-slim"
STAND_IN_BASE = "mtplx-base:bookworm"
RESULTS: list[tuple[str, bool, str]] = []


def log(message: str) -> None:
    print(f"[test-docker {time.strftime('%H:%M:%S')}] {message}", flush=True)


def docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)}: {done.stderr.strip()[-800:]}")
    return done


def check(name: str, ok: bool, detail: str) -> bool:
    RESULTS.append((name, ok, detail))
    log(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    return ok


def ensure_dockerd() -> None:
    if shutil.which("docker") is None:
        sys.exit("test-docker: no docker client (apt-get install docker.io)")
    if docker("info", timeout=30, check=False).returncode == 0:
        return
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        sys.exit("test-docker: the Docker daemon is not running (and cannot be started here)")
    log("starting dockerd (log: /tmp/mtplx-dockerd.log); it keeps running afterwards")
    with open("/tmp/mtplx-dockerd.log", "ab") as out:
        subprocess.Popen(["dockerd"], stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + 60
    while docker("info", timeout=30, check=False).returncode != 0:
        if time.monotonic() > deadline:
            sys.exit("test-docker: dockerd did not answer within 60 s")
        time.sleep(1)


def have_image(name: str) -> bool:
    return docker("image", "inspect", name, check=False).returncode == 0


def pull(name: str) -> bool:
    log(f"pulling {name} (60 s at most)")
    try:
        return docker("pull", name, timeout=60, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def choose_base(requested: str | None) -> str:
    """BASE_IMAGE as given, else python:3.11-slim when it is here or can be pulled, else the
    Debian stand-in (built once by docker/make_base.sh, then reused)."""
    if requested:
        if not (have_image(requested) or pull(requested)):
            sys.exit(f"test-docker: base image {requested} is neither local nor pullable")
        return requested
    if have_image(DEFAULT_BASE) or pull(DEFAULT_BASE):
        return DEFAULT_BASE
    if not have_image(STAND_IN_BASE):
        log(f"{DEFAULT_BASE} cannot be pulled: building {STAND_IN_BASE} with debootstrap")
        started = time.monotonic()
        subprocess.run(["sh", str(ROOT / "docker/make_base.sh"), STAND_IN_BASE], check=True)
        log(f"built {STAND_IN_BASE} in {time.monotonic() - started:.0f} s")
    else:
        log(f"{DEFAULT_BASE} cannot be pulled: using the existing stand-in {STAND_IN_BASE}")
    return STAND_IN_BASE


def build(image: str, base: str) -> None:
    cmd = ["docker", "build", "--network", "host", "-f", "docker/Dockerfile", "-t", image]
    cmd += ["--build-arg", f"BASE_IMAGE={base}"]
    if os.environ.get("PIP_INDEX_URL"):
        cmd += ["--build-arg", f"PIP_INDEX_URL={os.environ['PIP_INDEX_URL']}"]
    log(f"{' '.join(cmd)} .")
    started = time.monotonic()
    context = "?"
    with subprocess.Popen(
        [*cmd, "."], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"  | {line}", end="", flush=True)
            if "build context" in line:
                context = line.strip()
        code = proc.wait(timeout=3600)
    seconds = time.monotonic() - started
    if not check("build", code == 0, f"exit {code} in {seconds:.0f} s; {context}"):
        raise SystemExit(1)
    size = int(docker("image", "inspect", "-f", "{{.Size}}", image).stdout)
    check("image size", True, f"{size / 1e6:.0f} MB ({image}, base {base})")


def http(method: str, url: str, body: dict | None = None, key: str | None = None, timeout=60):
    """(status, body bytes) of one request; HTTP errors are answers, not exceptions."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_healthy(name: str, base: str, started: float) -> dict | None:
    """Poll /health until 200, then Docker's health status until "healthy" (bounded)."""
    health = None
    deadline = started + 300
    while time.monotonic() < deadline:
        try:
            status, body = http("GET", f"{base}/health", timeout=5)
        except OSError:
            status, body = 0, b""
        if status == 200:
            health = json.loads(body)
            break
        if docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip() != "true":
            break
        time.sleep(0.25)
    ready = time.monotonic() - started
    if not check("/health 200", health is not None, f"after {ready:.1f} s"):
        return None
    blas = health.get("blas", {})
    check("BLAS", bool(blas.get("fast")), f"{blas.get('name')} {blas.get('fallback_reason') or ''}")
    # Docker probes every 5 s (the Dockerfile's HEALTHCHECK): a few probes after /health
    # answers 200, however long the start took.
    state = docker("inspect", "-f", "{{.State.Health.Status}}", name).stdout.strip()
    until = time.monotonic() + 30
    while time.monotonic() < until and state != "healthy":
        time.sleep(0.25)
        state = docker("inspect", "-f", "{{.State.Health.Status}}", name).stdout.strip()
    check("docker healthy", state == "healthy", f"{state} after {time.monotonic() - started:.1f} s")
    return health


def chat_checks(base: str, key: str) -> None:
    url = f"{base}/v1/chat/completions"
    status, body = http("GET", f"{base}/v1/models", key=key)
    model = json.loads(body)["data"][0]["id"] if status == 200 else "?"
    check("/v1/models", status == 200, f"HTTP {status}, serving {model!r}")
    messages = [{"role": "user", "content": "Name three colours."}]
    request = {"model": model, "messages": messages, "max_tokens": 24, "temperature": 0}
    status, body = http("POST", url, request)
    check("401 without key", status == 401, f"HTTP {status} {body[:80]!r}")
    status, _ = http("POST", url, request, key=key + "x")
    check("401 wrong key", status == 401, f"HTTP {status}")

    started = time.monotonic()
    status, body = http("POST", url, request, key=key, timeout=120)
    seconds = time.monotonic() - started
    text = ""
    if status == 200:
        reply = json.loads(body)
        text = reply["choices"][0]["message"]["content"] or ""
        usage = reply.get("usage", {})
        detail = f"{seconds:.2f} s, {usage.get('completion_tokens')} tokens: {text!r}"
    else:
        detail = f"HTTP {status} {body[:200]!r}"
    check("chat completion", status == 200 and bool(text), detail)

    started = time.monotonic()
    events, pieces, last = 0, [], ""
    streamed = urllib.request.Request(
        url,
        data=json.dumps({**request, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(streamed, timeout=60) as response:
            deadline = time.monotonic() + 120
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data:"):
                    events, last = events + 1, line
                    payload = line[5:].strip()
                    if payload != "[DONE]":
                        for choice in json.loads(payload).get("choices", []):
                            pieces.append(choice.get("delta", {}).get("content") or "")
                if last == "data: [DONE]" or time.monotonic() > deadline:
                    break
        detail = f"{events} events in {time.monotonic() - started:.2f} s, last {last!r}"
        detail += f", same text as non-streamed: {''.join(pieces) == text}"
    except (OSError, ValueError) as exc:
        detail = f"{type(exc).__name__}: {exc}"
    check("streamed chat ends with [DONE]", last == "data: [DONE]" and events > 1, detail)


def run_container(image: str, name: str, key: str, *extra: str) -> tuple[str, float]:
    docker("rm", "-f", name, check=False)
    started = time.monotonic()
    docker("run", "-d", "--name", name, "-p", "127.0.0.1::8000", "-e", "MTPLX_API_KEY", *extra,
           image, timeout=120)  # fmt: skip
    port = docker("port", name, "8000/tcp").stdout.split()[0].rsplit(":", 1)[1]
    log(f"{name}: {' '.join(extra) or 'defaults'}; http://127.0.0.1:{port}")
    return f"http://127.0.0.1:{port}", started


def stop(name: str, label: str) -> None:
    started = time.monotonic()
    docker("stop", "-t", "10", name, timeout=60)
    seconds = time.monotonic() - started
    code = docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
    check(f"{label}docker stop", seconds < 9 and code != "137", f"{seconds:.1f} s, exit {code}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="mtplx:test")
    parser.add_argument("--base", default=os.environ.get("BASE_IMAGE") or None)
    parser.add_argument("--no-build", action="store_true", help="check an existing --image")
    args = parser.parse_args()
    total = time.monotonic()
    ensure_dockerd()
    if not args.no_build:
        build(args.image, choose_base(args.base))
    key = secrets.token_urlsafe(24)
    os.environ["MTPLX_API_KEY"] = key  # `-e MTPLX_API_KEY`: passed without showing in `ps`
    names = [f"mtplx-test-{os.getpid()}", f"mtplx-test-{os.getpid()}-ro"]
    try:
        base, started = run_container(args.image, names[0], key)
        if wait_healthy(names[0], base, started):
            uid = docker("exec", names[0], "sh", "-c", "awk '/^Uid/ {print $2}' /proc/1/status")
            user = docker("exec", names[0], "id", "-un", check=False).stdout.strip()
            check(
                "non-root",
                uid.stdout.strip() not in ("", "0"),
                f"pid 1 uid {uid.stdout.strip()} ({user})",
            )
            chat_checks(base, key)
        stop(names[0], "")

        hardened = ("--read-only", "--tmpfs", "/tmp:exec", "--user", "12345:12345")
        base, started = run_container(args.image, names[1], key, *hardened)
        if wait_healthy(names[1], base, started):
            chat_checks(base, key)
        stop(names[1], "read-only: ")
    finally:
        failed = [name for name, ok, _ in RESULTS if not ok]
        for name in names:
            if failed:
                logs = docker("logs", "--tail", "30", name, check=False)
                print(f"--- docker logs {name} ---\n{logs.stdout}{logs.stderr}", flush=True)
            docker("rm", "-f", name, check=False)
    print(f"\ntest-docker: {len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed in "
          f"{time.monotonic() - total:.0f} s")  # fmt: skip
    for name, ok, detail in RESULTS:
        print(f"  {'ok  ' if ok else 'FAIL'} {name:32} {detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
