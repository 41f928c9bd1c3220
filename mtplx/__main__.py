"""``python -m mtplx``: the ``mtplx`` command."""

import sys

from mtplx.cli import main

sys.exit(main())
