"""The ``mtplx`` process entry (``mtplx.cli.run``)."""

from __future__ import annotations

import sys

import pytest

from mtplx import cli


class _Exited(Exception):
    def __init__(self, how: str, code: int) -> None:
        super().__init__(how, code)
        self.how, self.code = how, code


@pytest.mark.parametrize(
    ("argv", "how"),
    [(["serve", "m"], "os._exit"), (["inspect", "m"], "sys.exit"), (["bench"], "sys.exit")],
)
def test_a_server_process_ends_without_interpreter_shutdown(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], how: str
) -> None:
    # After `mtplx serve` the process ends at once (its native threads are not torn down
    # by an interpreter shutdown); every other command exits the usual way.
    seen: list[list[str]] = []

    def main(given: list[str]) -> int:
        seen.append(given)
        return 3

    def os_exit(code: int) -> None:
        raise _Exited("os._exit", code)

    def sys_exit(code: int) -> None:
        raise _Exited("sys.exit", code)

    monkeypatch.setattr(cli, "main", main)
    monkeypatch.setattr(cli.os, "_exit", os_exit)
    monkeypatch.setattr(cli.sys, "exit", sys_exit)
    monkeypatch.setattr(sys, "argv", ["mtplx", *argv])
    with pytest.raises(_Exited) as exited:
        cli.run()
    assert (exited.value.how, exited.value.code) == (how, 3)
    assert seen == [argv]
