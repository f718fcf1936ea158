"""The web chat's pages: the chat page, the same page inside the widget's frame, and the
widget script a site embeds. Everything is served from this package (`static/`) with the
admin page's strict CSP (`gateway.http.pages`): no CDN, no inline script or style.

The frame is shown only to the sites of `[channels.web] allowed_origins`, checked twice:
by the browser, from the page's CSP (`frame-ancestors` names the site the widget says it
is on, when that site is allowed), and here, from the `origin` the widget passes and the
`Referer` the browser sends with it (when it sends one, it must be that site).
"""

from __future__ import annotations

import html
from urllib.parse import urlsplit

from aiohttp import hdrs, web

from channels.webchat.settings import WebChatSettings
from gateway.http.pages import page_headers

PREFIX = "/webchat"
API = f"{PREFIX}/api"
STATIC = f"{PREFIX}/static"

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<link rel="icon" href="{static}/favicon.svg">
<link rel="stylesheet" href="{static}/chat.css">
<script src="{static}/chat.js" defer></script>
</head>
<body data-api="{api}" data-embed="{embed}" class="{body_class}">
<div class="app">
  <header class="bar">
    <h1 id="title">{title}</h1>
    <div class="bar-actions">
      <details id="history">
        <summary>Conversations</summary>
        <nav aria-label="Conversations"><ul id="conversations"></ul></nav>
      </details>
      <button id="new" type="button" aria-label="New conversation">New<span class="wide">
        conversation</span></button>
    </div>
  </header>
  <p id="status" class="status" role="status"></p>
  <div id="earlier" class="earlier" hidden>
    <span id="earlier-what">An earlier conversation.</span>
    <button id="back" type="button">Back to the current conversation</button>
  </div>
  <main class="main">
    <ol id="log" class="log" role="log" aria-live="polite" aria-label="Messages"></ol>
    <p id="typing" class="typing" hidden>The assistant is writing&hellip;</p>
  </main>
  <form id="composer" class="composer" hidden>
    <label for="message" class="visually-hidden">Message</label>
    <textarea id="message" rows="2" placeholder="Write a message"
      aria-describedby="keys"></textarea>
    <ul id="attachments" class="attachments" aria-label="Files to send"></ul>
    <div class="actions">
      <button id="attach" type="button">Attach files</button>
      <input id="file" type="file" multiple hidden>
      <button id="stop" type="button" disabled>Stop</button>
      <button id="send" type="submit" class="primary">Send</button>
    </div>
    <p id="keys" class="hint">Enter sends, Shift+Enter starts a new line, Esc stops the
      answer.</p>
  </form>
  <form id="login" class="login" hidden>
    <label for="password">Password</label>
    <input id="password" type="password" autocomplete="current-password" required>
    <button type="submit" class="primary">Sign in</button>
    <p id="login-error" class="error" role="alert"></p>
  </form>
  <footer class="footer"><span id="who"></span></footer>
</div>
<noscript><p>This chat needs JavaScript.</p></noscript>
</body>
</html>
"""


def page(settings: WebChatSettings, *, embed: bool) -> str:
    """The chat page's HTML (the same page in the widget's frame with `embed`)."""
    return _PAGE.format(
        title=html.escape(settings.title),
        static=STATIC,
        api=API,
        embed="1" if embed else "0",
        body_class="embedded" if embed else "standalone",
    )


def page_response(
    settings: WebChatSettings, *, frame_ancestors: tuple[str, ...] = ()
) -> web.Response:
    return web.Response(
        text=page(settings, embed=bool(frame_ancestors)),
        content_type="text/html",
        charset="utf-8",
        headers=page_headers(frame_ancestors),
    )


def refusal(status: int, message: str) -> web.Response:
    """A page that says why it is not the chat (escaped; the strict CSP too)."""
    body = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Chat</title>'
        f"</head><body><p>{html.escape(message)}</p></body></html>"
    )
    return web.Response(
        text=body, status=status, content_type="text/html", charset="utf-8", headers=page_headers()
    )


def frame_origin(request: web.Request, allowed: list[str]) -> str | None:
    """The site the frame is for, when it may have it: the `origin` the widget passed is in
    `allowed`, and the browser's `Referer`, if any, is on that site. None otherwise."""
    claimed = request.query.get("origin", "")
    if claimed not in allowed:
        return None
    referer = request.headers.get(hdrs.REFERER)
    if referer:
        parts = urlsplit(referer)
        if f"{parts.scheme}://{parts.netloc}".lower() != claimed:
            return None
    return claimed
