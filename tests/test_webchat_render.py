"""The model's Markdown as HTML the chat page shows (channels/webchat/render.py): whatever a
reply holds, the HTML has only the allowlisted elements and attributes, links only to web
and mail addresses, and nothing that loads or runs."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from channels.webchat.render import ALLOWED, CELL_STYLES, LINK_REL, link_allowed, render

HOSTILE = [
    "<script>window.pwned = 1</script>",
    '<img src=x onerror="window.pwned = 2">',
    "<iframe src=https://evil.example></iframe>",
    "[click](javascript:alert(1))",
    "[click](JaVaScRiPt:alert(1))",
    "[click](&#106;avascript:alert(1))",
    "[click](data:text/html;base64,PHNjcmlwdD4=)",
    "[click](vbscript:msgbox)",
    '[x](https://ok.example "a" onmouseover="alert(1)")',
    '[x](https://ok.example/"onmouseover="alert(1))',
    "![pixel](https://tracker.example/p.gif)",
    '```js" onclick="alert(1)\nalert(1)\n```',
    "<style>body{display:none}</style>",
    "<a href=javascript:alert(1)>x</a>",
    "&lt;script&gt;alert(1)&lt;/script&gt;",
    "| a |\n|:-|\n| <b onclick=x>b</b> |",
    "<svg onload=alert(1)>",
    "[x](/webchat/api/logout)",
    "\u202egnp.exe",
]


class Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def problems(html: str) -> list[str]:
    found = []
    parser = Collect()
    parser.feed(html)
    for tag, attrs in parser.tags:
        allowed = ALLOWED.get(tag)
        if allowed is None:
            found.append(f"<{tag}>")
            continue
        for name, value in attrs.items():
            if name not in allowed:
                found.append(f"<{tag} {name}>")
            elif name == "href" and not link_allowed(value or ""):
                found.append(f"href={value}")
            elif name == "style" and value not in CELL_STYLES:
                found.append(f"style={value}")
            elif name == "class" and not re.fullmatch(
                r"language-[A-Za-z0-9_+#-]{1,30}", value or ""
            ):
                found.append(f"class={value}")
            elif name == "rel" and value != LINK_REL:
                found.append(f"rel={value}")
    return found


@pytest.mark.parametrize("text", HOSTILE)
def test_a_hostile_reply_becomes_text_or_allowed_markup(text: str) -> None:
    html = render(text)
    assert problems(html) == []
    assert "<script" not in html and "<img" not in html and "<iframe" not in html
    assert 'href="javascript' not in html.lower() and 'href="data' not in html.lower()


def test_links_open_apart_and_images_become_links() -> None:
    html = render("[docs](https://example.org/a) ![cat](https://example.org/cat.png)")
    assert html.count(f'rel="{LINK_REL}" target="_blank"') == 2
    assert '<a href="https://example.org/cat.png"' in html and ">cat</a>" in html


def test_markdown_still_renders() -> None:
    html = render("# Title\n\n**bold** and `code`\n\n```python\nprint('hi')\n```\n\n- a\n- b")
    assert "<h1>Title</h1>" in html and "<strong>bold</strong>" in html
    assert '<pre><code class="language-python">print(&#x27;hi&#x27;)' in html or (
        "<pre><code class=\"language-python\">print('hi')" in html
    )
    assert "<ul>" in html


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "<",
                ">",
                '"',
                "'",
                "=",
                "(",
                ")",
                "[",
                "]",
                "!",
                "`",
                "```",
                "&",
                "#",
                ";",
                ":",
                "\n",
                " ",
                "*",
                "_",
                "|",
                "-",
                "javascript:",
                "onerror",
                "script",
                "img",
                "a",
                "href",
                "https://x.example",
                "data:",
                "&#106;",
                "\\",
                "<!--",
                "-->",
            ]
        ),
        max_size=40,
    ).map("".join)
)
def test_no_text_makes_anything_but_allowed_markup(text: str) -> None:
    assert problems(render(text)) == []
