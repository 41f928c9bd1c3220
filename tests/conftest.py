"""Shared pytest set-up.

``import mtplx`` must come before anything imports ``mlx.core``: it routes libmlx's BLAS to
OpenBLAS (mtplx.blas), which only works before libmlx is loaded. Conftest files are imported
before test modules, so doing it here covers test modules that import mlx first.
"""

import mtplx  # noqa: F401
