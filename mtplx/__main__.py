"""``python -m mtplx``: the ``mtplx`` command."""

from mtplx.cli import run

run()
