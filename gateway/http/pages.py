"""Web pages served on the gateway's port: the strict security headers every page gets,
the static files of a package, and the checks a page's form or script request passes
(its origin, whether a Secure cookie will come back). The admin page and any channel
with pages of its own (mounted through `HttpServer.mount`) share them.

Promises (tested in tests/test_http_pages.py):
- `page_headers` lets only the page's own files run or style it, loads nothing from
  elsewhere, and lets no other site frame it, unless `frame_ancestors` names the origins
  that may (the framing check is the browser's: CSP `frame-ancestors`).
- `StaticFiles` serves only the files of one package folder whose suffix it knows, by
  their plain names (no path ever reaches the file system), with their type and
  `nosniff`; everything else is 404.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources
from urllib.parse import urlsplit

from aiohttp import hdrs, web

from gateway.http.auth import is_loopback

#: The types of the files a page may ship.
STATIC_TYPES = {
    ".js": "text/javascript",
    ".css": "text/css",
    ".txt": "text/plain",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}


def content_security_policy(frame_ancestors: Iterable[str] = ()) -> str:
    """Only the page's own scripts, styles and images; requests only to its own origin; no
    other site may frame it unless `frame_ancestors` lists the origins that may."""
    ancestors = " ".join(frame_ancestors) or "'none'"
    return (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        f"connect-src 'self'; form-action 'self'; frame-ancestors {ancestors}; "
        "base-uri 'none'"
    )


def page_headers(frame_ancestors: Iterable[str] = ()) -> dict[str, str]:
    """The headers of every HTML page: the CSP above, no sniffing, no caching, and a
    referrer policy under which Chromium sends the real `Origin` with a form POST."""
    ancestors = tuple(frame_ancestors)
    headers = {
        "Content-Security-Policy": content_security_policy(ancestors),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "same-origin",
        "Cache-Control": "no-store",
    }
    if not ancestors:
        headers["X-Frame-Options"] = "DENY"  # for browsers without frame-ancestors
    return headers


class StaticFiles:
    """The files of `folder` in package `package` (read once), served by `handler` at a
    route with a `{name}` part."""

    def __init__(self, package: str, folder: str = "static", *, max_age: int = 3600) -> None:
        self.max_age = max_age
        self.files: dict[str, tuple[bytes, str]] = {}
        for item in resources.files(package).joinpath(folder).iterdir():
            suffix = "." + item.name.rsplit(".", 1)[-1]
            if item.is_file() and suffix in STATIC_TYPES:
                self.files[item.name] = (item.read_bytes(), STATIC_TYPES[suffix])

    def response(self, name: str, headers: dict[str, str] | None = None) -> web.Response:
        """The file `name`; HTTPNotFound when there is none of that name."""
        found = self.files.get(name)
        if found is None:
            raise web.HTTPNotFound()
        body, content_type = found
        return web.Response(
            body=body,
            content_type=content_type,
            headers={
                "X-Content-Type-Options": "nosniff",
                "Cache-Control": f"max-age={self.max_age}",
                **(headers or {}),
            },
        )

    async def handler(self, request: web.Request) -> web.StreamResponse:
        return self.response(request.match_info["name"])


def same_origin(request: web.Request) -> bool:
    """No `Origin` header (not a browser, or an old one), or this page's own origin."""
    origin = request.headers.get(hdrs.ORIGIN)
    if origin is None:
        return True
    return urlsplit(origin).netloc.lower() == request.host.lower()


def secure_enough(request: web.Request) -> bool:
    """Will the browser send back a Secure cookie? Over HTTPS (here or at a proxy in
    front), or on loopback, which browsers treat as secure."""
    if request.secure or request.headers.get("X-Forwarded-Proto", "").lower() == "https":
        return True
    host = request.host.rsplit(":", 1)[0] if not request.host.endswith("]") else request.host
    return is_loopback(host) and is_loopback(request.remote or "")
