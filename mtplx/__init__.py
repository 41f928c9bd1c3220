"""MTPLX: exact speculative decoding on MLX behind an OpenAI-compatible server.

Importing the package does no work beyond installing one import hook: the first import of
``mlx`` (by any module, in any order after this one) first routes libmlx's BLAS/LAPACK to
OpenBLAS (``mtplx.blas``), which only works before libmlx is loaded. Processes that never
touch MLX (the HTTP layer's tests, ``mtplx --help``) never build or load the shim.
``MTPLX_BLAS=reference`` opts out.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

__version__ = "0.1.0"


class _FastBlasBeforeMlx(importlib.abc.MetaPathFinder):
    """Enables the fast BLAS just before ``mlx`` is first imported, then steps aside.

    It finds nothing itself (returns None), so the ordinary finders load ``mlx`` as usual.
    """

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname != "mlx" and not fullname.startswith("mlx."):
            return None
        # Removed first: enable_fast_blas looks up mlx's spec, which must not come back here.
        _uninstall()
        from mtplx.blas import enable_fast_blas

        enable_fast_blas()
        return None


def _uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _FastBlasBeforeMlx)]


if "mlx.core" in sys.modules:
    # Too late to interpose: enable_fast_blas only records (and logs) why.
    from mtplx.blas import enable_fast_blas as _enable_fast_blas

    _enable_fast_blas()
elif not any(isinstance(f, _FastBlasBeforeMlx) for f in sys.meta_path):
    sys.meta_path.insert(0, _FastBlasBeforeMlx())
