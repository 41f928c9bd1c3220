"""``mtplx serve`` with its main thread (the asyncio loop: HTTP, SSE) under cProfile; the
profile is written to argv[1] when the server stops (SIGINT)."""

import cProfile
import os
import sys

from mtplx.cli import main

profile = cProfile.Profile()
profile.enable()
try:
    main(["serve", *sys.argv[2:]])
finally:
    profile.disable()
    profile.dump_stats(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)
