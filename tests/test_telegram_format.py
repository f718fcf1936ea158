"""Markdown to Telegram HTML, and long replies split under the length limit: examples,
and the module's promises as properties (checked with the fake server's HTML parser,
which parses the way the Bot API does)."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from channels.telegram.format import (
    MIN_LIMIT,
    TELEGRAM_LIMIT,
    find_code_blocks,
    html_to_text,
    markdown_to_html,
    plan_chunks,
    split_markdown,
    utf16_len,
)
from tests.fakes.telegram_server import parse_html
from tests.fakes.telegram_server import utf16_len as server_utf16_len

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DOCS = settings(FAST, max_examples=60)


def visible(markdown: str) -> str:
    """What Telegram shows for a Markdown chunk sent as HTML (raises if refused)."""
    text, _ = parse_html(markdown_to_html(markdown))
    return text


def entity_types(markdown: str) -> list[str]:
    return [e["type"] for e in parse_html(markdown_to_html(markdown))[1]]


# --------------------------------------------------------------------------- HTML


def test_common_markdown_becomes_telegram_html() -> None:
    assert markdown_to_html("**bold** and __also this__") == "<b>bold</b> and <b>also this</b>"
    assert markdown_to_html("*it* and _it_") == "<i>it</i> and <i>it</i>"
    assert markdown_to_html("`a < b`") == "<code>a &lt; b</code>"
    assert markdown_to_html("~~gone~~") == "<s>gone</s>"
    assert markdown_to_html("***both***") == "<b><i>both</i></b>"
    assert markdown_to_html("[docs](https://x.io/a?b=1&c=2)") == (
        '<a href="https://x.io/a?b=1&amp;c=2">docs</a>'
    )
    assert markdown_to_html("# Title") == "<b>Title</b>"
    assert markdown_to_html("- one\n* two") == "• one\n• two"
    assert markdown_to_html("> said\n> this\nafter") == (
        "<blockquote>said\nthis</blockquote>\nafter"
    )
    assert markdown_to_html("1 < 2 & 3 > 2") == "1 &lt; 2 &amp; 3 &gt; 2"


def test_code_blocks_keep_their_language_and_text_verbatim() -> None:
    markdown = "Run:\n```python\nif a < b and c:\n    print('**not bold**')\n```\nDone."
    html = markdown_to_html(markdown)
    assert html == (
        'Run:\n<pre><code class="language-python">if a &lt; b and c:\n'
        "    print('**not bold**')</code></pre>\nDone."
    )
    text, entities = parse_html(html)
    assert entities == [{"type": "pre", "offset": 5, "length": 41, "language": "python"}]
    assert "**not bold**" in text


def test_what_is_not_markdown_stays_as_written() -> None:
    for plain in (
        "snake_case_name and __init__ files",
        "2*3*4 = 24",
        "*args, **kwargs",
        "price: 5 * 3",
        "[not a link](javascript:alert(1))",
        "a lone ` backtick and ** stars",
    ):
        assert visible(plain) == plain, plain
    assert entity_types("[not a link](javascript:alert(1))") == []


def test_an_unclosed_fence_runs_to_the_end() -> None:
    html = markdown_to_html("text\n```js\nlet x = 1 < 2")
    assert html.endswith('<pre><code class="language-js">let x = 1 &lt; 2</code></pre>')
    parse_html(html)


def test_visible_text_helper_matches_telegrams_parser() -> None:
    markdown = "**a** & <b> [l](https://e.x) `c` ```"
    assert html_to_text(markdown_to_html(markdown)) == visible(markdown)


@FAST
@given(st.text())
def test_any_text_converts_to_html_telegram_accepts_and_never_grows(text: str) -> None:
    html = markdown_to_html(text)
    shown, _ = parse_html(html)  # raises EntityParseError on anything Telegram refuses
    assert server_utf16_len(shown) <= utf16_len(text)
    assert html_to_text(html) == shown


_soup = st.lists(st.sampled_from([*"*_~`[]()<>&#\\ -\nab", "https://x.y", "> ", "```"]))


@FAST
@given(_soup.map("".join))
def test_markdown_soup_converts_to_valid_html(text: str) -> None:
    shown, _ = parse_html(markdown_to_html(text))
    assert server_utf16_len(shown) <= utf16_len(text)


# --------------------------------------------------------------------------- splitting


def test_a_short_reply_is_one_message() -> None:
    assert split_markdown("Hello **there**") == ["Hello **there**"]
    assert split_markdown("") == []
    assert split_markdown("\n\n  \n") == []


def test_utf16_units_are_counted_like_telegram() -> None:
    assert utf16_len("a😀é") == 4 == server_utf16_len("a😀é")
    chunks = split_markdown("😀" * 3000)
    assert [utf16_len(c) for c in chunks] == [4096, 1904]


def test_cuts_prefer_paragraphs_then_lines_then_words() -> None:
    para = " ".join(["word"] * 30)  # 149 characters
    text = f"{para}\n\n{para}\nline two\n\n{para}"
    assert split_markdown(text, 200) == [para, f"{para}\nline two", para]
    lines = "\n".join(["a line of text"] * 30)
    chunks = split_markdown(lines, 100)
    assert all(c.startswith("a line") and c.endswith("of text") for c in chunks)
    words = " ".join(["word"] * 100)
    assert all(c.endswith("word") and c.startswith("word") for c in split_markdown(words, 100))


def test_a_code_block_that_fits_moves_whole_to_the_next_message() -> None:
    code = "```sh\n" + "\n".join(f"echo {i}" for i in range(20)) + "\n```"
    text = "intro " * 20 + "\n\n" + code + "\n\nafter"
    chunks = split_markdown(text, len(code) + 10)
    assert chunks == [("intro " * 20).strip(), code + "\n\nafter"]


def test_a_long_code_block_is_closed_and_reopened_with_its_language() -> None:
    body = "\n".join(f"print({i})" for i in range(400))
    text = f"Here:\n```python\n{body}\n```\nThat's all."
    chunks = split_markdown(text)
    assert len(chunks) > 1
    for chunk in chunks:
        assert utf16_len(chunk) <= TELEGRAM_LIMIT
        assert chunk.count("```") == 2
        assert "pre" in entity_types(chunk)
    assert chunks[0].startswith("Here:\n```python\nprint(0)\n")
    assert all(c.startswith("```python\n") for c in chunks[1:])
    languages = {e.get("language") for c in chunks for e in parse_html(markdown_to_html(c))[1]}
    assert languages == {"python"}
    shown = "\n".join(visible(c) for c in chunks)
    assert all(f"print({i})" in shown for i in range(400))


def test_limit_below_the_minimum_is_refused() -> None:
    with pytest.raises(ValueError, match="at least"):
        plan_chunks("x", MIN_LIMIT - 1)


# --------------------------------------------------------------------------- properties

_words = st.lists(
    st.sampled_from([*"abcdefghij*_`<&[]()~#>\\é", "😀", "e\u0301"]), min_size=1, max_size=12
).map("".join)
_long_words = st.text(alphabet=st.sampled_from("xy😀\u200d"), min_size=40, max_size=300)
_prose_line = st.lists(st.one_of(_words, _words, _long_words), max_size=25).map(" ".join)
_paragraph = st.lists(_prose_line, min_size=1, max_size=6).map("\n".join)
_code_line = st.text(alphabet="abc =()<>&*_\t 😀", max_size=150)


@st.composite
def _code_block(draw: st.DrawFn, *, closed: bool = True) -> str:
    opener = draw(st.sampled_from(["```", "```python", "~~~", "```js extra info", "  ```"]))
    closer = "~~~" if opener.startswith("~") else "```"
    lines = draw(st.lists(_code_line, max_size=25))
    body = "".join(line + "\n" for line in lines)
    return f"{opener}\n{body}{closer if closed else ''}"


@st.composite
def _document(draw: st.DrawFn) -> str:
    """Prose and code blocks; only the last block may lack its closing fence."""
    parts = draw(st.lists(st.one_of(_paragraph, _code_block()), min_size=1, max_size=6))
    if draw(st.booleans()):
        parts.append(draw(_code_block(closed=False)))
    return draw(st.sampled_from(["\n\n", "\n"])).join(parts)


_documents = _document()
_limits = st.integers(min_value=MIN_LIMIT, max_value=400)
_FENCE_LINE = re.compile(r"^ {0,3}(```|~~~)", re.MULTILINE)


def _check_chunks(text: str, limit: int) -> list[str]:
    plan = plan_chunks(text, limit)
    assert "".join(c.body for c in plan) == text  # in order, nothing lost or added
    assert [c.start for c in plan] == [0, *[c.end for c in plan[:-1]]][: len(plan)]
    rendered = [c.render() for c in plan]
    for chunk in rendered:
        assert utf16_len(chunk) <= limit
        shown, _ = parse_html(markdown_to_html(chunk))
        assert server_utf16_len(shown) <= limit
        assert all(block.closed for block in find_code_blocks(chunk))
    assert split_markdown(text, limit) == [c for c in rendered if c.strip()]
    return rendered


@DOCS
@given(_documents, _limits)
def test_chunks_fit_keep_the_text_and_balance_their_code_blocks(text: str, limit: int) -> None:
    for chunk in _check_chunks(text, limit):
        # Independently of the splitter's own parser: the documents here hold no
        # fence-like lines inside code, so fence lines come in pairs per chunk.
        assert len(_FENCE_LINE.findall(chunk)) % 2 == 0, chunk


@FAST
@given(st.text(), _limits)
def test_any_text_splits_within_the_limit(text: str, limit: int) -> None:
    _check_chunks(text, limit)


@DOCS
@given(_documents, _limits)
def test_a_code_block_that_fits_is_never_cut(text: str, limit: int) -> None:
    cuts = {c.end for c in plan_chunks(text, limit)[:-1]}
    for block in find_code_blocks(text):
        closing = 0 if block.closed else 4
        if utf16_len(text[block.start : block.end]) + closing <= limit:
            assert not any(block.start < cut < block.end for cut in cuts)
