"""Fact lines of MEMORY.md (`gateway.memory.facts`): ids, origins and corrections in a
comment that survives any session key, and old lines without one."""

from __future__ import annotations

from datetime import date

from gateway.memory.facts import (
    Correction,
    Fact,
    Origin,
    fact_id,
    find_facts,
    memory_facts,
    parse_fact_line,
    rewrite_memory,
)
from gateway.memory.format import memory_documents, parse_fact

DAY = date(2025, 3, 1)


def test_a_comment_round_trips_any_session_key_and_name() -> None:
    hostile = "slack:C1:thread:1.2 --> <b>%20 \n"
    fact = Fact(
        "0123abcd",
        "learned_fact",
        "Has a cat",
        DAY,
        Origin(hostile, "e 1"),
        Correction("2025-03-02T10:00:00Z", "telegram:42 (/correct)"),
    )
    line = fact.line()
    assert line.count("-->") == 1 and "\n" not in line
    assert parse_fact_line(line, DAY) == fact
    # People and searches see the fact without its comment.
    assert parse_fact(line) is not None and parse_fact(line).text == "Has a cat"  # type: ignore[union-attr]
    assert memory_documents(line) == [("- [learned_fact] Has a cat", "learned_fact")]


def test_lines_without_our_comment_get_derived_ids_and_keep_their_text() -> None:
    content = (
        "Free text\n- [user_preference] Tea <!-- my own note -->\n"
        "### Consolidated 2025-03-01\n- plain bullet\n- [learned_fact] x <!-- fact zz -->\n"
    )
    own, plain, odd = memory_facts(content)
    assert own.text == "Tea <!-- my own note -->" and own.day is None
    assert own.id == fact_id(None, "user_preference", "Tea <!-- my own note -->")
    assert (plain.category, plain.text, plain.id) == (
        "",
        "plain bullet",
        fact_id(DAY, "", "plain bullet"),
    )
    assert odd.id == fact_id(DAY, "learned_fact", "x")  # an unusable id is not taken
    # A plain fact without origin is written as earlier versions wrote it.
    assert plain.line() == "- plain bullet"


def test_rewrite_touches_only_the_lines_of_that_id() -> None:
    content = (
        "### Consolidated 2025-03-01\n- [learned_fact] A\n\n- [learned_fact] B\n"
        "- [learned_fact] A\n"
    )
    ident = fact_id(DAY, "learned_fact", "A")
    out, found = rewrite_memory(content, ident, lambda _: None)
    assert out == "### Consolidated 2025-03-01\n\n- [learned_fact] B\n" and len(found) == 2
    assert rewrite_memory(content, "ffffffff", lambda _: None) == (content, [])


def test_find_by_id_first_then_by_every_word() -> None:
    facts = memory_facts("### Consolidated 2025-03-01\n- [x] Red bike\n- [x] Blue bike\n")
    red, blue = facts
    assert find_facts(facts, red.id.upper()) == [red]
    assert find_facts(facts, "bike") == [red, blue]
    assert find_facts(facts, "blue BIKE") == [blue]
    assert find_facts(facts, "green") == [] and find_facts(facts, "  ") == []
