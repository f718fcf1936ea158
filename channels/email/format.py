"""Email text both ways: the new text of a message a person wrote (quoted history and
signature cut, HTML read as text), and a reply's Markdown as a plain and an HTML part.
Pure functions; no IMAP or SMTP here.

Promises (tested in tests/test_email_format.py):
- `new_text` never returns less than the person wrote above the quoted history: it cuts
  only at an attribution line ("On ... wrote:", in the common languages), an Outlook
  header block or "-----Original Message-----", a trailing block of `>` lines, or a
  signature after "-- "; interleaved quotes (a reply between quoted lines) stay, so the
  answer keeps its context. A message that would be cut to nothing is kept whole.
- `html_to_text` keeps the text a person sees (paragraphs, line breaks, list items,
  links as `text (url)`), never the content of <script>, <style> or <head>, and drops the
  quoted history mail clients mark in their HTML (Gmail's `gmail_quote`, Apple Mail's and
  Thunderbird's `<blockquote type="cite">`, Outlook's `divRplyFwdMsg`/`appendonsend`).
- `markdown_to_html` escapes any HTML the model wrote (it is shown as text) and makes
  no link other than http(s) and mailto.
"""

from __future__ import annotations

import functools
import html
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from markdown_it import MarkdownIt

# --------------------------------------------------------------------------- subjects

#: Reply prefixes of the common mail clients (English, German, Nordic, Dutch, Italian,
#: French, Spanish, Portuguese): a subject that has one gets no second.
_REPLY_PREFIX = re.compile(r"^\s*(re|aw|sv|vs|antw|r|rif|ref|réf|res|ynt)\s*(\[\d+\])?\s*:", re.I)
DEFAULT_SUBJECT = "A message from your assistant"


def reply_subject(subject: str) -> str:
    """The subject of a reply: `Re: <subject>`, without stacking prefixes."""
    subject = " ".join(subject.split())
    if not subject:
        return "Re: your message"
    if _REPLY_PREFIX.match(subject):
        return subject
    return f"Re: {subject}"


# --------------------------------------------------------------------------- HTML in

#: Elements whose content is never text a person reads.
_INVISIBLE = ("script", "style", "head", "title", "template", "noscript")
#: Elements after which a line ends.
_BLOCKS = frozenset(
    {
        "p",
        "div",
        "section",
        "article",
        "header",
        "footer",
        "main",
        "aside",
        "nav",
        "table",
        "tr",
        "ul",
        "ol",
        "dl",
        "dt",
        "dd",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "pre",
        "blockquote",
        "address",
        "figure",
        "figcaption",
        "hr",
        "form",
        "fieldset",
    }
)
#: Quoted history and signatures, as mail clients mark them in their HTML (XPath).
_QUOTE_MARKS = (
    "//*[contains(concat(' ', normalize-space(@class), ' '), ' gmail_quote ')]",
    "//*[contains(concat(' ', normalize-space(@class), ' '), ' gmail_signature ')]",
    "//blockquote[@type='cite']",
    "//*[contains(concat(' ', normalize-space(@class), ' '), ' moz-cite-prefix ')]",
    "//*[contains(concat(' ', normalize-space(@class), ' '), ' moz-signature ')]",
    "//*[@id='divRplyFwdMsg']",
    "//*[@id='appendonsend']",
    "//*[contains(concat(' ', normalize-space(@class), ' '), ' yahoo_quoted ')]",
)
#: Outlook puts the quoted history after these, as siblings: everything after goes too.
_CUT_AFTER = ("divRplyFwdMsg", "appendonsend")


def html_to_text(markup: str) -> str:
    """The text a person sees in an HTML mail, without the quoted history clients mark."""
    from lxml import etree
    from lxml import html as lxml_html

    if not markup.strip():
        return ""
    try:
        root = lxml_html.document_fromstring(markup)
    except (etree.ParserError, ValueError):
        return html.unescape(re.sub(r"<[^>]*>", " ", markup))
    for marker in _CUT_AFTER:
        for node in root.xpath(f"//*[@id='{marker}']"):
            for later in list(node.itersiblings()):
                later.getparent().remove(later)
    for path in _QUOTE_MARKS:
        for node in root.xpath(path):
            parent = node.getparent()
            if parent is not None:
                node.drop_tree()
    for name in _INVISIBLE:
        for node in root.iter(name):
            node.drop_tree()
    pieces: list[str] = []
    _walk(root, pieces, preformatted=False)
    text = "".join(pieces)
    lines = [line.rstrip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _walk(node: object, out: list[str], *, preformatted: bool) -> None:
    from lxml import etree

    tag = getattr(node, "tag", None)
    if not isinstance(tag, str):  # a comment or a processing instruction
        tail = getattr(node, "tail", None)
        if tail:
            out.append(tail if preformatted else _squeeze(tail))
        return
    element: etree._Element = node  # type: ignore[assignment]
    name = tag.lower()
    pre = preformatted or name == "pre"
    if name == "br":
        out.append("\n")
    elif name == "li":
        out.append("\n- ")
    elif name in _BLOCKS:
        out.append("\n")
    if element.text:
        out.append(element.text if pre else _squeeze(element.text))
    for child in element:
        _walk(child, out, preformatted=pre)
    if name == "a":
        href = (element.get("href") or "").strip()
        shown = "".join(element.itertext()).strip()
        if href.startswith(("http://", "https://")) and href != shown:
            out.append(f" ({href})")
    if name in _BLOCKS:
        out.append("\n")
    if name == "td" or name == "th":
        out.append("\t")
    if element.tail:
        out.append(element.tail if preformatted else _squeeze(element.tail))


def _squeeze(text: str) -> str:
    return re.sub(r"[ \t\r\n\f\v\u00a0]+", " ", text)


# --------------------------------------------------------------------------- new text

#: "On Tue, 3 Mar 2026 at 10:00, Alice <a@example.org> wrote:" and its translations; a
#: client may wrap it over two lines, so it is matched on a line and the next one.
_ATTRIBUTION = re.compile(
    r"^\s*(on|am|le|el|il|op|em|den|på|w dniu|dne)\b.{0,300}?"
    r"(wrote|schrieb|a écrit|escribió|ha scritto|schreef|escreveu|skrev|napisał|napsal)"
    r"(\s.{0,120}?)?\s*:\s*$",
    re.I | re.S,
)
_ORIGINAL = re.compile(
    r"^\s*-{2,}\s*(original message|ursprüngliche nachricht|message d'origine|"
    r"mensaje original|messaggio originale|oorspronkelijk bericht)\s*-{2,}\s*$",
    re.I,
)
#: Outlook's plain-text header block: "From:" with "Sent:"/"Date:" right after.
_HEADER_FROM = re.compile(r"^\s*\*?(from|von|de|van|da|fra|od)\s*:\*?\s", re.I)
_HEADER_NEXT = re.compile(
    r"^\s*\*?(sent|date|gesendet|datum|envoyé|enviado|fecha|inviato|verzonden|"
    r"to|an|à|para|a|aan|til|do|subject|betreff|objet|asunto|oggetto|onderwerp)\s*:",
    re.I,
)
_UNDERSCORES = re.compile(r"^\s*_{10,}\s*$")
_SIGNATURE = re.compile(r"^-- ?$")
#: "Sent from my iPhone" and the like, at the very end.
_SENT_FROM = re.compile(
    r"^\s*(sent from my|sent from outlook|get outlook for|von meinem .* gesendet|"
    r"envoyé de mon|enviado desde mi)\b.{0,60}$",
    re.I,
)
_SIGNATURE_MAX_LINES = 12


def new_text(plain: str) -> str:
    """What the person wrote in this message: `plain` without the quoted history below
    it and without their signature. See the module docstring for the rules."""
    lines = plain.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    cut = _history_start(lines)
    kept = lines[:cut]
    kept = _without_trailing_quote(kept)
    kept = _without_signature(kept)
    text = "\n".join(kept).strip("\n")
    if not text.strip():
        return plain.strip()
    return text.rstrip()


def _history_start(lines: list[str]) -> int:
    """The index of the first line of the quoted history, or len(lines)."""
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        if _ORIGINAL.match(line) or (_UNDERSCORES.match(line) and _header_block(lines, i + 1)):
            return i
        if _HEADER_FROM.match(line) and _header_block(lines, i):
            return i
        if _ATTRIBUTION.match(line) and _quoted_after(lines, i + 1):
            return i
        wrapped = i + 1 < len(lines) and _ATTRIBUTION.match(f"{line} {lines[i + 1]}")
        if wrapped and _quoted_after(lines, i + 2):
            return i
    return len(lines)


def _header_block(lines: list[str], start: int) -> bool:
    """Does an Outlook-style "From: ... Sent: ..." block start at `start`?"""
    rest = [line for line in lines[start : start + 6] if line.strip()]
    if not rest or not _HEADER_FROM.match(rest[0]):
        return False
    return sum(1 for line in rest[1:5] if _HEADER_NEXT.match(line)) >= 2


def _quoted_after(lines: list[str], start: int) -> bool:
    """Is the text after an attribution line quoted (or nothing but blank lines and
    quotes)? A line saying "... wrote:" in the person's own text is not a cut."""
    rest = [line for line in lines[start:] if line.strip()]
    return not rest or rest[0].lstrip().startswith(">")


def _without_trailing_quote(lines: list[str]) -> list[str]:
    end = len(lines)
    while end and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith(">")):
        end -= 1
    return lines[:end]


def _without_signature(lines: list[str]) -> list[str]:
    end = len(lines)
    while end and not lines[end - 1].strip():
        end -= 1
    if end and _SENT_FROM.match(lines[end - 1]):
        end -= 1
    for i in range(end - 1, max(-1, end - _SIGNATURE_MAX_LINES - 2), -1):
        if _SIGNATURE.match(lines[i]):
            return lines[:i]
    return lines[:end]


# --------------------------------------------------------------------------- reply out


@functools.cache
def _markdown() -> MarkdownIt:
    from markdown_it import MarkdownIt

    renderer = MarkdownIt("commonmark", {"html": False, "breaks": True, "linkify": False})
    renderer.enable(["table", "strikethrough"])
    allowed = renderer.validateLink

    def validate(url: str) -> bool:
        return allowed(url) and url.strip().lower().startswith(("http://", "https://", "mailto:"))

    renderer.validateLink = validate  # type: ignore[method-assign]
    return renderer


_STYLE = (
    "body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;font-size:15px;"
    "line-height:1.5;color:#1f2328}pre{background:#f6f8fa;padding:8px;border-radius:4px;"
    "overflow:auto}code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:90%}"
    "table{border-collapse:collapse}td,th{border:1px solid #d0d7de;padding:4px 8px}"
    "blockquote{margin:0;padding-left:12px;border-left:3px solid #d0d7de;color:#57606a}"
)


def markdown_to_html(markdown: str) -> str:
    """The HTML part of a reply: the model's Markdown rendered (CommonMark with tables
    and strikethrough), in a small standalone document."""
    body = _markdown().render(markdown)
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8">'
        f"<style>{_STYLE}</style></head><body>{body}</body></html>"
    )
