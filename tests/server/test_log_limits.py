"""``RateLimitFilter``: one record per message template per interval, then a count of the
dropped ones; the loggers a client can flood get it."""

from __future__ import annotations

import logging

from server.log_limits import FLOODABLE_LOGGERS, RateLimitFilter, limit_log_floods


def _record(message: str, name: str = "asyncio") -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, message, None, None)


def test_one_record_per_template_per_interval_then_the_count() -> None:
    now = [0.0]
    limiter = RateLimitFilter(interval=10, clock=lambda: now[0])
    flood = "socket.accept() out of system resource\nsocket: <fd=6>"
    passed = [limiter.filter(_record(flood)) for _ in range(100_000)]
    assert passed.count(True) == 1
    assert limiter.filter(_record("another message"))
    now[0] = 10.0
    record = _record(flood)
    assert limiter.filter(record)
    assert "99999 more like this" in record.getMessage()


def test_floodable_loggers_get_one_filter_once() -> None:
    limit_log_floods()
    limiter = limit_log_floods()
    for name in FLOODABLE_LOGGERS:
        filters = [f for f in logging.getLogger(name).filters if isinstance(f, RateLimitFilter)]
        assert filters == [limiter]
        logging.getLogger(name).removeFilter(limiter)
