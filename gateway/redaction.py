"""The one redactor: every configured secret, and anything shaped like a token, taken out
of text before a person, a log, a scraper or a trace backend sees it.

The promise kept here: a configured secret of `MIN_SECRET_CHARS` characters or more is
never shown, wherever it stands in a text, as it is or in the encodings text carries it
in (below). `Settings.redactor` builds the process's one `Redactor` from the validated
settings (`gateway.config.section.secret_items` finds the secrets by their type); the log,
the admin page, /readyz, /metrics, traces, the doctor and the replies all use it.

What is replaced, by `***`:

| what | found | replaced |
|---|---|---|
| a configured secret | anywhere, inside words too, in every `encodings` form | all of it |
| a URL's password | `scheme://user:password@host` | the password |
| a bearer token | `Bearer <token>` | the token |
| an API key | `api_key=<key>`, `api-key: <key>` | the key |
| OpenAI, Slack tokens | `sk-...`, `xoxb-...`, `xapp-...` at a word start | after the prefix |
| a Telegram bot token | `<bot id>:<35 characters>`, in API URLs too | after the colon |

The encodings of a configured secret: as it is, URL-encoded (`%3A`, `+`), percent-decoded,
HTML-escaped (`&amp;`, `&#34;`, `&quot;`) and backslash-escaped (JSON strings, Prometheus
label values).

A configured secret shorter than `MIN_SECRET_CHARS` is not replaced as plain text: it
would turn ordinary words and numbers into `***` everywhere. It is still caught where a
shape puts it (a URL's password, a bearer header), and `gateway doctor` warns of it.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterable
from urllib.parse import quote, quote_plus, unquote, urlsplit

#: What replaces a secret.
MASK = "***"

#: Configured secrets shorter than this are replaced only where a shape puts them.
MIN_SECRET_CHARS = 6

# Shapes of secrets worth catching even when not configured: bearer tokens, `api_key=`
# values, OpenAI keys (`sk-` only at a word start: "ask-questions" is not a key), Slack
# tokens, Telegram bot tokens (`<bot id>:<35 characters>`, also inside API URLs) and the
# password of a URL (`scheme://user:password@`).
_TOKEN_SHAPES = re.compile(
    r"(?i)(bearer\s+|api[_-]?key[=:]\s*|\bsk-|\bxox[abposr]-|\bxapp-)[A-Za-z0-9._\-]{6,}"
    r"|(?<![A-Za-z0-9])(bot)?(\d{6,}:)[A-Za-z0-9_-]{30,}"
    r"|(?<=://)([^\s:/?#@\[\]]*:)[^\s/?#@]+@"
)


def _keep_prefix(match: re.Match[str]) -> str:
    prefix, bot, bot_id, user = match.group(1, 2, 3, 4)
    if prefix is not None:
        return prefix + MASK
    if bot_id is not None:
        return (bot or "") + bot_id + MASK
    return f"{user}{MASK}@"


def encodings(secret: str) -> set[str]:
    """`secret` as text may carry it: as it is, URL-encoded and percent-decoded (a URL's
    password is read still encoded), HTML-escaped (Jinja2's and the standard library's
    entities) and backslash-escaped (a JSON string, a Prometheus label value)."""
    forms = {secret, quote(secret, safe=""), quote_plus(secret, safe=""), unquote(secret)}
    for form in list(forms):
        forms.add(html.escape(form, quote=True))
        forms.add(
            form.replace("&", "&amp;")
            .replace("<", "&lt;")
            .replace(">", "&gt;")
            .replace('"', "&#34;")
            .replace("'", "&#39;")
        )
        forms.add(json.dumps(form, ensure_ascii=False)[1:-1])
    return {form for form in forms if len(form) >= MIN_SECRET_CHARS}


class Redactor:
    """Replaces configured secrets (`secrets`) and token shapes with `***` (the module's
    table). Immutable once built, so any thread may use it."""

    __slots__ = ("_forms",)

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        forms = {form for s in secrets if len(s) >= MIN_SECRET_CHARS for form in encodings(s)}
        # Longest first: a secret that holds another is replaced whole.
        self._forms = tuple(sorted(forms, key=lambda form: (-len(form), form)))

    def redact(self, text: str) -> str:
        """`text` without configured secrets and without token shapes: for what an
        operator or a program reads (logs, the admin page, probes, metrics, traces)."""
        return _TOKEN_SHAPES.sub(_keep_prefix, self.redact_configured(text))

    def redact_configured(self, text: str) -> str:
        """`text` without configured secrets, token shapes left alone: for what a chat
        user reads, whose own text may hold a "Bearer ..." that is no secret of ours."""
        for form in self._forms:
            if form in text:
                text = text.replace(form, MASK)
        return text


def redact_url(url: str) -> str:
    """`url` with the password of its `user:password@` part replaced by `***`."""
    return _TOKEN_SHAPES.sub(_keep_prefix, url) if "@" in url else url


def url_password(url: str) -> str | None:
    """The password of `url`'s `user:password@` part, as written (percent-encoded)."""
    try:
        return urlsplit(url).password
    except ValueError:
        return None
