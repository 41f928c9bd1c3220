"""The README's and docs/' examples, run as a reader would run them.

A fenced ``sh`` or ``python`` block right after the line ``<!-- runnable:
tests/test_docs_examples.py -->`` is run as is against a live ``mtplx serve`` on the default
model (its ``http://127.0.0.1:8000`` pointed at the test server's port): shell blocks with
bash, Python blocks in a fresh interpreter. A block passes when it exits 0, prints something,
and what curl prints is a JSON reply or an SSE stream ending with ``data: [DONE]``, with no
error in it. Live processes and the default model: the e2e tier (``make test-e2e``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.server.live import ROOT, live_servers

pytestmark = pytest.mark.e2e

MARK = "<!-- runnable: tests/test_docs_examples.py -->"
DEFAULT_URL = "http://127.0.0.1:8000"
FENCE = re.compile(r"^```(sh|python)\s*$")
TIMEOUT = 300  # seconds a block may take (the Python API example loads the model itself)


@dataclass(frozen=True)
class Example:
    path: str
    line: int
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def _examples() -> list[Example]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != MARK:
                continue
            opening = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            assert opening, f"{path.name}:{i + 1}: the mark must precede a ```sh or ```python fence"
            end = lines.index("```", i + 2)
            code = "\n".join(lines[i + 2 : end]) + "\n"
            found.append(Example(str(path.relative_to(ROOT)), i + 2, opening.group(1), code))
    return found


EXAMPLES = _examples()


def test_the_readme_shows_a_curl_an_openai_and_an_anthropic_request() -> None:
    readme = [e for e in EXAMPLES if e.path == "README.md"]
    assert any(e.language == "sh" and "curl" in e.code for e in readme)
    assert any("from openai import OpenAI" in e.code for e in readme)
    assert any("import anthropic" in e.code for e in readme)
    # Every topic page with requests has examples that run.
    pages = {e.path for e in EXAMPLES}
    assert {"docs/serving.md", "docs/structured-output.md"} <= pages


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``mtplx serve`` with its defaults on the default model (a cold machine calibrates the
    step costs first: minutes on 2 cores)."""
    log = tmp_path_factory.mktemp("docs") / "server.log"
    with live_servers(None, [log], healthy_within=600) as (url,):
        yield url


def _check_curl_output(example: Example, output: str) -> None:
    text = output.strip()
    assert text, f"{example.id}: curl printed nothing"
    if text.startswith("data:") or text.startswith("event:"):
        assert "data: [DONE]" in text, f"{example.id}: the stream did not end: {text[-500:]}"
        assert '"error"' not in text, f"{example.id}: {text[-500:]}"
        return
    reply = json.loads(text)
    assert "error" not in reply, f"{example.id}: {reply}"


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_example_runs_against_a_live_server(example: Example, server: str) -> None:
    code = example.code.replace(DEFAULT_URL, server)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if example.language == "sh":
        command = ["bash", "-euo", "pipefail", "-c", code]
    else:
        command = [sys.executable, "-c", code]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert done.returncode == 0, (
        f"{example.id} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )
    assert done.stdout.strip(), f"{example.id} printed nothing:\n{done.stderr[-2000:]}"
    if example.language == "sh" and example.code.lstrip().startswith("curl"):
        _check_curl_output(example, done.stdout)
