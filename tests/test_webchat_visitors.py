"""Who a browser is (channels/webchat/visitors.py): a signed cookie names its visitor, and
nothing else does; a new password ends every cookie; a change needs the cookie's CSRF
token."""

from __future__ import annotations

import pytest

from channels.webchat.visitors import VisitorKeys, new_visitor_id

DAY = 86400


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_cookie_names_its_visitor_until_it_expires() -> None:
    clock = Clock()
    keys = VisitorKeys("the-key", clock=clock)
    visitor = keys.issue("Ann_visitor-1", DAY)
    checked = keys.check(visitor.cookie)
    assert checked is not None and checked.id == "Ann_visitor-1" and checked.csrf == visitor.csrf
    clock.now += DAY
    assert keys.check(visitor.cookie) is None


@pytest.mark.parametrize(
    "tamper",
    [
        lambda c: c[:-1] + ("A" if c[-1] != "A" else "B"),  # the MAC
        lambda c: c.replace("v1.Ann", "v1.Bob", 1),  # another visitor
        lambda c: c.replace(".18", ".28", 1),  # a later expiry
        lambda c: "v2" + c[2:],  # another version
        lambda c: "",
        lambda c: c + "." + "x" * 400,
    ],
)
def test_an_altered_cookie_names_nobody(tamper: object) -> None:
    keys = VisitorKeys("the-key", clock=Clock())
    cookie = keys.issue("Ann", DAY).cookie
    assert keys.check(tamper(cookie)) is None  # type: ignore[operator]


def test_another_key_or_a_new_password_ends_every_cookie() -> None:
    clock = Clock()
    cookie = VisitorKeys("the-key", password="old secret", clock=clock).issue("owner", DAY).cookie
    assert VisitorKeys("the-key", password="old secret", clock=clock).check(cookie) is not None
    assert VisitorKeys("the-key", password="new secret", clock=clock).check(cookie) is None
    assert VisitorKeys("the-key", clock=clock).check(cookie) is None
    assert VisitorKeys("another-key", password="old secret", clock=clock).check(cookie) is None


def test_the_csrf_token_belongs_to_one_cookie() -> None:
    keys = VisitorKeys("the-key", clock=Clock())
    ann, bob = keys.issue("Ann", DAY), keys.issue("Bob", DAY)
    assert VisitorKeys.csrf_ok(ann, ann.csrf)
    assert not VisitorKeys.csrf_ok(ann, bob.csrf)
    assert not VisitorKeys.csrf_ok(ann, "")
    assert not VisitorKeys.csrf_ok(ann, None)
    # A new cookie for the same visitor (renewed) has a token of its own.
    assert keys.issue("Ann", 2 * DAY).csrf != ann.csrf


def test_the_password_is_compared_whole() -> None:
    keys = VisitorKeys("the-key", password="correct horse")
    assert keys.needs_password and keys.password_matches("correct horse")
    assert not keys.password_matches("correct hors") and not keys.password_matches("")
    assert not VisitorKeys("the-key").password_matches("")


def test_visitor_ids_are_random_and_of_the_cookie_shape() -> None:
    ids = {new_visitor_id() for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == 22 for i in ids)
    with pytest.raises(ValueError):
        VisitorKeys("k").issue("not.an.id", DAY)
