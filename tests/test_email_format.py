"""The email channel's text both ways (channels.email.format): the new text of a mail a
person wrote, HTML read as text, and a reply's Markdown as HTML."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from channels.email.format import html_to_text, markdown_to_html, new_text, reply_subject

# -- new text --------------------------------------------------------------------------


def test_gmail_style_attribution_and_quote_are_cut() -> None:
    mail = (
        "Sounds good, see you at 10.\n\n"
        "On Tue, 3 Mar 2026 at 09:12, Bot <bot@example.org> wrote:\n"
        "> Shall we meet tomorrow?\n"
        ">\n"
        "> Bot\n"
    )
    assert new_text(mail) == "Sounds good, see you at 10."


def test_an_attribution_wrapped_over_two_lines_is_cut() -> None:
    mail = (
        "Yes please.\n\nOn Tue, 3 Mar 2026 at 09:12, A Very Long Name\n"
        "<someone@example.org> wrote:\n> question\n"
    )
    assert new_text(mail) == "Yes please."


def test_german_and_french_attributions_are_cut() -> None:
    assert new_text("Danke!\n\nAm 03.03.2026 um 09:12 schrieb Bot:\n> Frage\n") == "Danke!"
    assert new_text("Merci\n\nLe 3 mars 2026, Bot a écrit :\n> question\n") == "Merci"


def test_outlook_header_block_is_cut() -> None:
    mail = (
        "Please send the report.\n\n"
        "________________________________\n"
        "From: Bot <bot@example.org>\n"
        "Sent: Tuesday, March 3, 2026 9:12 AM\n"
        "To: Alice <alice@example.org>\n"
        "Subject: Report\n\n"
        "Here is the old text.\n"
    )
    assert new_text(mail) == "Please send the report."


def test_original_message_separator_is_cut() -> None:
    mail = "Thanks\n\n-----Original Message-----\nFrom: x\nold\n"
    assert new_text(mail) == "Thanks"


def test_signature_after_the_delimiter_is_cut() -> None:
    mail = "What is 2+2?\n\n-- \nAlice Example\nACME Corp\n+1 555 0100\n"
    assert new_text(mail) == "What is 2+2?"


def test_sent_from_my_phone_is_cut() -> None:
    assert new_text("Call me.\n\nSent from my iPhone\n") == "Call me."


def test_interleaved_quotes_stay_for_context() -> None:
    mail = "> Which day?\nTuesday.\n> Which time?\nTen.\n"
    assert new_text(mail) == "> Which day?\nTuesday.\n> Which time?\nTen."


def test_a_wrote_line_in_the_persons_own_text_is_not_a_cut() -> None:
    mail = "On Monday my colleague wrote:\nthe plan is fine.\nWhat do you think?"
    assert new_text(mail) == mail


def test_indentation_of_code_is_kept() -> None:
    mail = "Why does this fail?\n\n    def f():\n        return 1\n"
    assert new_text(mail) == "Why does this fail?\n\n    def f():\n        return 1"


def test_a_mail_that_is_all_quote_is_kept_whole() -> None:
    mail = "> only a quote\n> nothing else\n"
    assert new_text(mail) == mail.strip()


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=300))
def test_new_text_is_never_empty_for_text_with_content(text: str) -> None:
    result = new_text(text)
    assert bool(result.strip()) == bool(text.strip())


# -- HTML in ---------------------------------------------------------------------------


def test_html_paragraphs_breaks_lists_and_links() -> None:
    markup = (
        "<html><head><style>p{color:red}</style><title>x</title></head><body>"
        "<p>Hello <b>there</b>,</p><p>line one<br>line two</p>"
        "<ul><li>apples</li><li>pears</li></ul>"
        '<p>See <a href="https://example.org/doc">the doc</a>.</p>'
        "<script>alert(1)</script></body></html>"
    )
    text = html_to_text(markup)
    assert text == (
        "Hello there,\n\nline one\nline two\n\n- apples\n- pears\n\n"
        "See the doc (https://example.org/doc)."
    )


def test_gmail_quote_in_html_is_dropped() -> None:
    markup = (
        '<div dir="ltr">Yes, Tuesday works.</div><br>'
        '<div class="gmail_quote"><div class="gmail_attr">On Mon, Bot wrote:</div>'
        "<blockquote>Does Tuesday work?</blockquote></div>"
    )
    assert html_to_text(markup) == "Yes, Tuesday works."


def test_apple_mail_cite_and_outlook_reply_block_are_dropped() -> None:
    apple = 'Fine by me.<br><blockquote type="cite">Earlier text</blockquote>'
    assert html_to_text(apple) == "Fine by me."
    outlook = (
        "<div>Agreed.</div><hr><div id='divRplyFwdMsg'><b>From:</b> Bot</div>"
        "<div>old message body</div>"
    )
    assert html_to_text(outlook) == "Agreed."


def test_pre_keeps_its_lines() -> None:
    assert html_to_text("<p>Code:</p><pre>a  = 1\n  b = 2</pre>") == "Code:\n\na  = 1\n  b = 2"


# -- out -------------------------------------------------------------------------------


def test_markdown_renders_and_escapes_raw_html() -> None:
    out = markdown_to_html(
        "**bold** and <script>alert(1)</script>\n\n| a | b |\n|---|---|\n| 1 | 2 |"
    )
    assert "<strong>bold</strong>" in out
    assert "<script>" not in out and "&lt;script&gt;" in out
    assert "<table>" in out


def test_markdown_links_only_to_web_and_mail() -> None:
    out = markdown_to_html("[ok](https://example.org) [bad](javascript:alert(1)) [f](file:///etc)")
    assert 'href="https://example.org"' in out
    assert "javascript:" not in out.split("</style>")[1].replace("[bad](javascript:", "")
    assert 'href="javascript' not in out and 'href="file' not in out


def test_reply_subject_does_not_stack_prefixes() -> None:
    assert reply_subject("Lunch") == "Re: Lunch"
    assert reply_subject("Re: Lunch") == "Re: Lunch"
    assert reply_subject("AW: Mittag") == "AW: Mittag"
    assert reply_subject("RE[2]: x") == "RE[2]: x"
    assert reply_subject("  ") == "Re: your message"
    assert reply_subject("Reminder: call") == "Re: Reminder: call"
