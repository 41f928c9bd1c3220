"""The typed error for a request value the engine cannot use.

``InvalidParameter`` is a ``ValueError`` (callers that catch ValueError keep working) that
carries the name of the offending field, so the HTTP layer reports ``param`` from the error
itself instead of guessing it from the message text.
"""

from __future__ import annotations

__all__ = ["InvalidParameter"]


class InvalidParameter(ValueError):
    """A bad request value. ``param`` is the engine's field name (``temperature``,
    ``logit_bias``, ``prompt_ids``, ``seed`` ...); ``code`` an OpenAI-style error code."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code
