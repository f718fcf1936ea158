"""A local web site for `web_fetch` tests: pages, redirects, huge, slow and binary answers.

Routes: ``/article`` (an HTML article inside navigation and a footer),
``/long?kb=N&seed=S`` (an article of about N kB whose access code, `page_code(S)`, is
said in its middle only), ``/plain``, ``/data.json``, ``/image.png``, ``/huge?mb=N``
(N MiB of text, streamed), ``/slow`` (a byte a second, for a minute at most),
``/redirect?to=URL`` (302), ``/loop`` (a redirect to itself), ``/missing`` (404).
Every request is logged (`paths`), so a test
can tell that a refused fetch never reached the server.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from tests.fakes._serving import LocalServer

ARTICLE_TITLE = "Otters hold hands while sleeping"
ARTICLE_SENTENCE = (
    "Sea otters often hold paws while they sleep so that they do not drift apart, "
    "a habit known as rafting."
)
ARTICLE_HTML = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{ARTICLE_TITLE}</title></head>
<body>
<nav><a href="/">Home</a> | <a href="/about">About</a> | <a href="/shop">Shop</a></nav>
<article>
<h1>{ARTICLE_TITLE}</h1>
<p>{ARTICLE_SENTENCE}</p>
<p>Groups of otters can number in the dozens; the largest rafts counted held more
than a thousand animals resting together in kelp forests along the coast.</p>
</article>
<footer>Copyright 2026 Example Wildlife Pages. All rights reserved.</footer>
<script>var tracking = "SCRIPT_TEXT_MUST_NOT_APPEAR";</script>
</body></html>
"""
PNG_BYTES = b"\x89PNG\r\n\x1a\n" + bytes(64)


def page_code(seed: int) -> str:
    """The access code `/long?seed=S` states once, in the middle of its text."""
    return f"PG-{seed:03d}-{(seed * 7919) % 100000:05d}"


def long_page(kb: int, seed: int) -> str:
    """An HTML article of about `kb` kilobytes of prose paragraphs (menus and a footer
    around it), its access code said once, in the middle."""
    paragraphs: list[str] = []
    n = 0
    while sum(map(len, paragraphs)) < kb * 1000:
        paragraphs.append(
            f"<p>Section {n} of report {seed}: the river otters of district {n % 17} were "
            f"counted at dawn; {n * 13 % 97} adults and {n * 7 % 31} young rested in the "
            f"kelp, and the survey team noted the water at {10 + n % 9} degrees.</p>"
        )
        n += 1
    middle = len(paragraphs) // 2
    paragraphs.insert(middle, f"<p>The access code of page {seed} is {page_code(seed)}.</p>")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>Report {seed}</title>"
        "</head><body><nav><a href='/'>Home</a> | <a href='/about'>About</a></nav>"
        f"<article><h1>Report {seed}</h1>{''.join(paragraphs)}</article>"
        "<footer>Copyright 2026 Example Wildlife Pages.</footer></body></html>"
    )


class FakeWeb(LocalServer):
    _thread_name = "fake-web"

    def __init__(self) -> None:
        super().__init__()
        self._paths: list[str] = []

    @property
    def paths(self) -> list[str]:
        """Paths requested so far, oldest first (a snapshot)."""
        with self._lock:
            return list(self._paths)

    def _build_app(self) -> web.Application:
        @web.middleware
        async def log(request: web.Request, handler: web.Handler) -> web.StreamResponse:
            with self._lock:
                self._paths.append(request.path_qs)
            self._notify()
            return await handler(request)

        app = web.Application(middlewares=[log])
        app.router.add_get("/article", self._article)
        app.router.add_get("/long", self._long)
        app.router.add_get("/plain", self._plain)
        app.router.add_get("/data.json", self._json)
        app.router.add_get("/image.png", self._image)
        app.router.add_get("/huge", self._huge)
        app.router.add_get("/slow", self._slow)
        app.router.add_get("/redirect", self._redirect)
        app.router.add_get("/loop", self._loop_redirect)
        return app

    async def _article(self, request: web.Request) -> web.Response:
        return web.Response(text=ARTICLE_HTML, content_type="text/html", charset="utf-8")

    async def _long(self, request: web.Request) -> web.Response:
        html = long_page(int(request.query.get("kb", "30")), int(request.query.get("seed", "0")))
        return web.Response(text=html, content_type="text/html", charset="utf-8")

    async def _plain(self, request: web.Request) -> web.Response:
        return web.Response(text="just plain text\nline two\n", content_type="text/plain")

    async def _json(self, request: web.Request) -> web.Response:
        return web.json_response({"otters": 3})

    async def _image(self, request: web.Request) -> web.Response:
        return web.Response(body=PNG_BYTES, content_type="image/png")

    async def _huge(self, request: web.Request) -> web.StreamResponse:
        megabytes = int(request.query.get("mb", "50"))
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        line = b"otters " * 146 + b"\n"  # 1023 bytes
        block = line * 1024
        for _ in range(megabytes):
            await response.write(block)
        await response.write_eof()
        return response

    async def _slow(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        for _ in range(60):
            await response.write(b"z")
            await asyncio.sleep(1.0)
        await response.write_eof()
        return response

    async def _redirect(self, request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query["to"])

    async def _loop_redirect(self, request: web.Request) -> web.Response:
        raise web.HTTPFound("/loop")
