"""The errors a ticket of the engine bridge raises on the asyncio side; routes turn them into
HTTP statuses (server/errors.py)."""

from __future__ import annotations

__all__ = [
    "BridgeError",
    "EngineNotReady",
    "GenerationFailed",
    "QueueFull",
    "RequestTimeout",
    "ShuttingDown",
]


class BridgeError(Exception):
    """Base of the errors a ticket can raise on the asyncio side."""


class QueueFull(BridgeError):
    """The waiting queue is at capacity; ``retry_after`` is a hint in whole seconds."""

    def __init__(self, depth: int, retry_after: int) -> None:
        super().__init__(f"the request queue is full ({depth} waiting); retry later")
        self.retry_after = retry_after


class EngineNotReady(BridgeError):
    """The engine is still loading, failed to load, or the bridge has stopped."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDown(EngineNotReady):
    """The server is draining or stopped: no new work, running work ends."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down")


class RequestTimeout(BridgeError):
    """The ticket ran past its deadline (waiting plus generating)."""


class GenerationFailed(BridgeError):
    """``engine.generate`` raised; the original exception is ``__cause__``."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(f"generation failed: {type(error).__name__}: {error}")
        self.index = index
        self.error = error
