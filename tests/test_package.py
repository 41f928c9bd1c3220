"""The package's boundaries, checked on the source: the HTTP layer imports without MLX, the
engine package never imports the HTTP layer, ``import mtplx`` does no work, and no two
``mtplx`` modules import each other, directly or through others."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.test_blas import FAST_PATH_EXPECTED

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mtplx"
# The command line puts the engine and the server together, so it alone may import server/.
COMPOSITION_ROOTS = {"mtplx.cli"}
WEB_STACK = ("server", "fastapi", "starlette", "uvicorn", "sse_starlette")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    """Every module ``path`` imports (at module level or inside a function), absolute."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            # ``from mtplx import engine`` imports the module mtplx.engine.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    """mtplx module -> the mtplx modules it imports (a submodule import counts as an import of
    its package too, since Python runs the package's ``__init__`` first)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for imported in _imports(path, name):
            parts = imported.split(".")
            for end in range(1, len(parts) + 1):
                target = ".".join(parts[:end])
                if target in modules and target != name and not name.startswith(target + "."):
                    edges.add(target)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_no_import_cycle_among_mtplx_modules() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_the_engine_package_never_imports_the_web_stack() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        if name in COMPOSITION_ROOTS:
            continue
        for imported in _imports(path, name):
            if imported.split(".")[0] in WEB_STACK:
                offenders.append(f"{name} imports {imported}")
    assert offenders == []


_BLOCK_MLX = """
import importlib.abc, sys

class BlockMlx(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("mlx", "mlx_lm"):
            raise ImportError(f"{name} is blocked")
        return None

sys.meta_path.insert(0, BlockMlx())
"""


def test_the_server_imports_with_mlx_blocked() -> None:
    done = _run(
        _BLOCK_MLX
        + """
import importlib, pkgutil
import server
names = [m.name for m in pkgutil.walk_packages(server.__path__, "server.")]
for name in names:
    importlib.import_module(name)
from server.app import create_app
from tests.fake_engine import FakeEngine
app = create_app(FakeEngine())
assert not any(m.split(".")[0] in ("mlx", "mlx_lm") for m in sys.modules)
print(len(names))
"""
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) > 20  # every server module was imported


def test_importing_mtplx_does_no_work() -> None:
    done = _run(
        """
import sys
import mtplx
loaded = sorted(m for m in sys.modules if m.startswith(("mtplx.", "mlx", "ctypes")))
print(loaded)
"""
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_fast_blas_comes_with_the_first_mlx_import() -> None:
    done = _run(
        """
import mtplx
from mtplx.blas import blas_info
before = blas_info().fallback_reason
import mlx.core
after = blas_info()
print(before)
print(after.fast or after.fallback_reason)
"""
    )
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.strip().splitlines()
    assert before == "enable_fast_blas() has not been called"
    assert after == "True" if FAST_PATH_EXPECTED else after != before
