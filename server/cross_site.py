"""Protection of a local server from the web pages its user visits.

A page cannot read replies from another origin, but it can still make the browser send
requests: a ``text/plain`` POST needs no CORS preflight (``parse_json_body`` answers 415 to
anything but ``application/json``), and a DNS-rebinding page reaches 127.0.0.1 under its own
host name. ``HostCheckMiddleware`` refuses a ``Host`` header naming anything but this
machine, unless the operator allowed more (``allowed_hosts``).
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import APIError
from server.settings import ServerSettings, is_loopback

__all__ = ["LOOPBACK_NAMES", "HostCheckMiddleware", "allowed_host_names", "host_name"]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def allowed_host_names(settings: ServerSettings) -> frozenset[str] | None:
    """The Host names to accept (lower case, no port), or None for any.

    On a loopback bind: the loopback names plus ``allowed_hosts``. On a public bind the
    API key guards the server and any Host is accepted, unless ``allowed_hosts`` names some
    (then those plus the loopback names). ``*`` in ``allowed_hosts`` accepts any."""
    extra = {name.strip().lower().strip("[]") for name in settings.allowed_hosts}
    if "*" in extra:
        return None
    if not extra and not is_loopback(settings.host):
        return None
    return LOOPBACK_NAMES | frozenset(extra)


def host_name(header: str) -> str:
    """The name part of a Host header: ``[::1]:8000`` -> ``::1``, ``a.b:80`` -> ``a.b``;
    ``""`` (matching no allowed name) when anything but a port follows the name
    (``[::1]evil.com``, ``localhost:80evil``)."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        if end < 0:
            return ""
        name, rest = header[1:end], header[end + 1 :]
    else:
        name, colon, port = header.partition(":")
        rest = colon + port
        name = name.rstrip(".")  # "localhost." is localhost
    port = rest[1:]
    if rest and not (rest.startswith(":") and (port == "" or (port.isdigit() and port.isascii()))):
        return ""
    return name


class HostCheckMiddleware:
    """400 with OpenAI error JSON when the Host header names a host not in ``allowed``.

    A request without a Host header (HTTP/1.0, raw ASGI) passes: browsers always send
    one, so its absence is not a rebinding attack."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str]) -> None:
        self.app = app
        self.allowed = frozenset(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"host" and host_name(value.decode("latin-1")) not in self.allowed:
                error = APIError(
                    400,
                    "Invalid Host header: this server only answers to "
                    f"{', '.join(sorted(self.allowed))} (see the allowed_hosts setting).",
                    code="invalid_host",
                )
                await error.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)
