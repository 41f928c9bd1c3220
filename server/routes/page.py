"""GET / (the chat page) and GET /static/<file> (its script, style and icon), shipped in the
package (``server/static``, package data) and read once.

The page and its files are open even with an API key (a browser cannot send a header when it
opens a page; the page asks for the key and sends it as a Bearer token). Every one of them
goes out with a strict Content-Security-Policy: scripts and styles from this origin only, no
inline code, requests to this origin only, no framing, and Trusted Types required, so even a
bug in the page cannot turn model text into HTML."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from server.errors import APIError

__all__ = ["CONTENT_SECURITY_POLICY", "SECURITY_HEADERS", "STATIC_FILES", "router"]

router = APIRouter()

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
        "require-trusted-types-for 'script'",
        "trusted-types 'none'",
    ]
)

SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    # Small files: revalidate each load, so a server upgrade shows its page at once.
    "Cache-Control": "no-cache",
}

# The files /static/ serves, by name: nothing else under the package can be asked for.
STATIC_FILES = {
    "chat.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}


@cache
def _read(name: str) -> bytes:
    return resources.files("server").joinpath("static", name).read_bytes()


def _file(name: str, media_type: str) -> Response:
    return Response(_read(name), media_type=media_type, headers=SECURITY_HEADERS)


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def chat_page() -> Response:
    """The chat page."""
    return _file("index.html", "text/html; charset=utf-8")


@router.api_route("/static/{name}", methods=["GET", "HEAD"], include_in_schema=False)
async def static_file(name: str) -> Response:
    """One of the page's files, or 404."""
    media_type = STATIC_FILES.get(name)
    if media_type is None:
        raise APIError(404, f"No static file named {name!r}", code="unknown_url")
    return _file(name, media_type)
