"""Logging that a flood of events cannot turn into a flood of log lines.

``RateLimitFilter`` lets one record per message template through per interval and drops
the rest, counting them; the next record let through says how many were dropped. It goes
on the loggers whose messages a client can trigger at will: asyncio's (``socket.accept()
out of system resource`` is logged once per failed accept), uvicorn's (one warning per
malformed request), the connection limits' and the unexpected-error handler's (one
traceback per 500).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

__all__ = ["FLOODABLE_LOGGERS", "RateLimitFilter", "limit_log_floods"]

FLOODABLE_LOGGERS = ("asyncio", "uvicorn.error", "mtplx.connections", "server.errors")


class RateLimitFilter(logging.Filter):
    """At most one record per (logger, message template) every ``interval`` seconds. The
    template is the first line of the unformatted message (asyncio's exception handler
    puts the details on the lines after it)."""

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval = interval
        self.clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self._dropped: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` goes out; a record after dropped ones carries their count."""
        key = (record.name, str(record.msg).split("\n", 1)[0][:200])
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return False
        if len(self._last) > 1024:  # templates are few; bound the table anyway
            self._last.clear()
        self._last[key] = now
        dropped = self._dropped.pop(key, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like this in the last {self.interval:g}s)"
        return True


def limit_log_floods(
    names: Iterable[str] = FLOODABLE_LOGGERS, interval: float = 10.0
) -> RateLimitFilter:
    """Put one ``RateLimitFilter`` on each named logger (once); returns it."""
    limiter = RateLimitFilter(interval)
    for name in names:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, RateLimitFilter)]:
            logger.removeFilter(old)
        logger.addFilter(limiter)
    return limiter
