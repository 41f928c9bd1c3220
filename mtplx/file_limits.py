"""Importing mlx-lm without letting it change the process's open-file limits.

``mlx_lm.utils`` sets ``RLIMIT_NOFILE`` to ``(2048, 4096)`` when it is imported. That lowers
a higher hard limit for good (an unprivileged process cannot raise it back, so a server
started under ``ulimit -n 65536`` would be held to 4,096 connections), and it raises
``ValueError`` (the import fails) where the hard limit is below 4,096. What it wants is
room for the many files of a large checkpoint: a soft limit of at least 2,048, which this
module grants within the hard limit instead.
"""

from __future__ import annotations

import importlib
import resource
import sys
from collections.abc import Callable

#: The soft limit mlx-lm asks for at import.
MLX_LM_SOFT_LIMIT = 2048


def soft_limit_within_hard(
    wanted_soft: int,
    setrlimit: Callable[[int, tuple[int, int]], None] = resource.setrlimit,
) -> None:
    """Raise the soft ``RLIMIT_NOFILE`` to ``wanted_soft`` as far as the hard limit allows;
    never lower either."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted_soft:
        return
    target = wanted_soft if hard == resource.RLIM_INFINITY else min(wanted_soft, hard)
    if target > soft:
        setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def import_mlx_lm() -> None:
    """Import ``mlx_lm.utils`` (and with it the ``mlx_lm`` package) with its file-limit
    change replaced by :func:`soft_limit_within_hard`. Call it before anything else imports
    mlx-lm (the command line's entry point does); once mlx-lm is imported it does nothing.
    Not thread-safe: it swaps ``resource.setrlimit`` for the length of the import."""
    if "mlx_lm.utils" in sys.modules:
        return
    real_setrlimit = resource.setrlimit

    def setrlimit(which: int, limits: tuple[int, int], /) -> None:
        if which == resource.RLIMIT_NOFILE:
            soft_limit_within_hard(limits[0], real_setrlimit)
        else:
            real_setrlimit(which, limits)

    resource.setrlimit = setrlimit
    try:
        importlib.import_module("mlx_lm.utils")
    finally:
        resource.setrlimit = real_setrlimit
