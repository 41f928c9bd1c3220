"""Static checks of the container files (no Docker engine runs in CI)."""

from __future__ import annotations

from pathlib import Path

import yaml

DOCKER = Path(__file__).resolve().parents[1] / "docker"


def test_dockerfile_runs_as_non_root_with_a_healthcheck():
    lines = [line.strip() for line in (DOCKER / "Dockerfile").read_text().splitlines()]
    assert lines[0].startswith("#") and any(line == "FROM python:3.11-slim" for line in lines)
    users = [line for line in lines if line.startswith("USER ")]
    assert users and users[-1] != "USER root"
    assert any(line.startswith("HEALTHCHECK") for line in lines)
    assert any("/health" in line for line in lines)
    assert any("ensure_default_model" in line for line in lines)  # model baked at build
    assert any(line.startswith('ENTRYPOINT ["mtplx", "serve"]') for line in lines)


def test_compose_requires_an_api_key_and_publishes_on_loopback():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    service = compose["services"]["mtplx"]
    assert service["build"]["dockerfile"] == "docker/Dockerfile"
    assert "?" in service["environment"]["MTPLX_API_KEY"]  # ${VAR:?message}: required
    assert all(port.startswith("127.0.0.1:") for port in service["ports"])
