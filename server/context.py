"""What every route needs, kept on ``app.state.ctx``: the bridge, settings, metrics and
the host facts /health reports."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from server.bridge_errors import ShuttingDown
from server.engine_bridge import EngineBridge, EngineLike
from server.errors import APIError
from server.metrics import ServerMetrics
from server.reasoning import ReasoningParser, reasoning_parser
from server.settings import ServerSettings

__all__ = ["AppContext", "get_context"]


@dataclass
class AppContext:
    """Per-app state shared by the routes."""

    bridge: EngineBridge
    settings: ServerSettings
    metrics: ServerMetrics
    blas_info: Callable[[], Any] | None = None
    started_at: float = field(default_factory=time.time)
    _reasoning: tuple[Any, ReasoningParser | None] | None = field(default=None, repr=False)

    def item_limits(self, *fields: str) -> dict[str, int]:
        """At most as many items in each of ``fields`` (messages, tools, input items) as
        the context has tokens: each renders one token at least. Checked on the parsed
        JSON before validation, which holds the GIL (a 15 MB body of 420k messages
        stalled every request for 5 s). Empty while the model loads."""
        if self.bridge.state != "ready":
            return {}
        return dict.fromkeys(fields, self.bridge.engine.context_length)

    def max_json_len(self) -> int | None:
        """The most items any array or object in a generation request may hold: the
        context's tokens or the vocabulary, whichever is larger (a prompt of token ids, a
        ``logit_bias`` over the vocabulary). None while the model loads."""
        if self.bridge.state != "ready":
            return None
        engine = self.bridge.engine
        return max(engine.context_length, getattr(engine, "vocab_size", 0))

    def engine(self) -> EngineLike:
        """The engine, or a 503 APIError while it loads (or after it failed to), or while the
        server drains for shutdown."""
        state = self.bridge.state
        if state != "ready":
            failure = getattr(self.bridge, "failure", None)  # failed after loading
            if failure is not None:
                message = f"The engine failed: {failure}"
            elif state == "failed":
                message = f"The model failed to load: {self.bridge.load_error}"
            elif state in ("draining", "stopped"):
                raise APIError(503, str(ShuttingDown()), code="server_shutting_down")
            else:
                message = "The model is loading; retry shortly."
            headers = {"Retry-After": "5"} if state in ("created", "loading") else None
            raise APIError(503, message, code="model_not_ready", headers=headers)
        return self.bridge.engine

    def reasoning_parser(self) -> ReasoningParser | None:
        """The served model's reasoning parser (``settings.reasoning_parser``), None when
        replies are not split; worked out once per tokenizer."""
        tokenizer = self.engine().tokenizer
        if self._reasoning is None or self._reasoning[0] is not tokenizer:
            self._reasoning = (
                tokenizer,
                reasoning_parser(tokenizer, self.settings.reasoning_parser),
            )
        return self._reasoning[1]

    def model_id(self) -> str:
        """The id clients use in ``model``."""
        return self.settings.served_model_name or self.bridge.engine.model_name

    def model_names(self) -> set[str]:
        """Every value ``model`` may take: the served name, the engine's name, the path."""
        names = {self.model_id(), self.bridge.engine.model_name}
        if self.settings.model:
            names.add(self.settings.model)
        return names


def get_context(request: Request) -> AppContext:
    """The AppContext of the app serving ``request``."""
    return request.app.state.ctx
