"""`resolve_session`, the one place a session name sent to the HTTP API becomes a key:
each caller's namespace, every spelling of another client's key, the operator's reach.
End to end through the daemon: tests/test_api_isolation.py."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.http.namespace import (
    CHAT_CALLER,
    OPERATOR,
    STATELESS_PREFIX,
    Caller,
    Route,
    SessionRefused,
    resolve_session,
    throwaway_session_key,
)
from gateway.sessions.keys import encode_key

IDE = Caller("ide", Route.OPENAI, ("ide-",))
DEFAULT_V1 = Caller("default", Route.OPENAI)


def refused(caller: Caller, sent: str) -> SessionRefused:
    with pytest.raises(SessionRefused) as raised:
        resolve_session(caller, sent)
    return raised.value


# --------------------------------------------------------------------------- /api/chat


@pytest.mark.parametrize(
    "sent",
    [
        "api:ide:ide-proj",  # the request
        "api:ide:ide-",
        "api:ide:x:sub:1",  # a subagent's session: its memory is api:ide:x's
        "api:IDE:ide-proj",  # one file on a case-insensitive file system
        "api:Ide:ide-proj",
        "api:\uff49\uff44\uff45:ide-proj",  # fullwidth "ide"
        "api:ide\uff1aide-proj",  # fullwidth colon
        "api:ide\ufe55ide-proj",  # small colon
        "api:api:ide:ide-proj",  # a prefix written twice
        "api:a:b",  # no client "a" today; a client of that name may come
        "api:Default:x",  # not the token's own spelling
        "api:\uff44\uff45\uff46\uff41\uff55\uff4c\uff54:x",  # fullwidth "default"
        "api:-:x",
    ],
)
def test_a_name_of_another_clients_form_is_403_saying_what_is_allowed(sent: str) -> None:
    error = refused(CHAT_CALLER, sent)
    assert error.status == 403
    assert error.message.startswith("session:")
    assert "api:<name>" in error.message and "api:default:<name>" in error.message
    assert sent not in error.message  # the answer tells nothing of whose it would be


@pytest.mark.parametrize(
    "sent",
    ["ide:ide-proj", "default:work", "API:ide:ide-proj", "telegram:1", "ide:ide-proj:sub:1"],
)
def test_a_key_of_no_api_form_is_400_as_another_channels(sent: str) -> None:
    error = refused(CHAT_CALLER, sent)
    assert error.status == 400 and "api:<name>" in error.message


@pytest.mark.parametrize(
    ("sent", "key"),
    [
        ("ide", "api:ide"),  # the client's bare name: a chat session, not its namespace
        ("api:ide", "api:ide"),
        ("ide-proj", "api:ide-proj"),  # its prefix rule's names: the chat client's own
        ("api:\u0456de:ide-proj", "api:\u0456de:ide-proj"),  # Cyrillic: a key of its own
        ("api%3Aide%3Aide-proj", "api:api%3Aide%3Aide-proj"),  # percent-encoding is text
        ("api:ide%3Aide-proj", "api:ide%3Aide-proj"),
        ("api:my notes: monday", "api:my notes: monday"),
        ("api:default:work", "api:default:work"),  # the same token's /v1 session "work"
    ],
)
def test_other_spellings_stay_in_the_callers_namespace(sent: str, key: str) -> None:
    assert resolve_session(CHAT_CALLER, sent) == key
    assert encode_key(key) != encode_key("api:ide:ide-proj")


def test_the_tokens_own_v1_sessions_follow_v1s_rules() -> None:
    assert resolve_session(CHAT_CALLER, "api:default:work") == resolve_session(DEFAULT_V1, "work")
    assert refused(CHAT_CALLER, f"api:default:{STATELESS_PREFIX}x").status == 400
    assert refused(CHAT_CALLER, "api:default:").status == 400


def test_the_chat_layout_is_the_http_tokens_alone() -> None:
    """`api:<name>` has no client part: a named client resolving names there would
    share the `[http] token`'s conversations, so it is a programming error."""
    with pytest.raises(ValueError):
        resolve_session(Caller("ide", Route.CHAT), "work")


# --------------------------------------------------------------------------- /v1


def test_a_v1_client_is_put_in_front_of_every_name_it_sends() -> None:
    assert resolve_session(IDE, "ide-proj") == "api:ide:ide-proj"
    assert resolve_session(IDE, "ide-x:api:default:work") == "api:ide:ide-x:api:default:work"
    assert resolve_session(DEFAULT_V1, "api:ide:ide-proj") == "api:default:api:ide:ide-proj"
    assert resolve_session(DEFAULT_V1, "ide-proj") == "api:default:ide-proj"


@pytest.mark.parametrize("sent", ["main", "IDE-proj", "\u0456de-proj", " ide-proj", "ide"])
def test_a_name_outside_the_clients_prefixes_is_403(sent: str) -> None:
    error = refused(IDE, sent)
    assert error.status == 403 and error.message.startswith("user:") and "'ide-'" in error.message


def test_v1_names_are_printable_storable_and_not_the_gateways_own() -> None:
    assert refused(DEFAULT_V1, f"{STATELESS_PREFIX}abc").status == 400
    assert refused(IDE, "ide-\u202eevil").status == 400
    too_long = refused(IDE, "ide-" + "x" * 200)
    assert too_long.status == 400 and "the limit is 188" in too_long.message
    resolve_session(IDE, "ide-" + "x" * 184)  # 188 plain characters fit


def test_a_stateless_session_is_in_its_callers_namespace_and_found_again() -> None:
    key = throwaway_session_key(IDE, "retry-1")
    assert key.startswith(f"api:ide:{STATELESS_PREFIX}")
    assert throwaway_session_key(IDE, "retry-1") == key
    assert throwaway_session_key(DEFAULT_V1, "retry-1") != key.replace(":ide:", ":default:")
    encode_key(key)


# --------------------------------------------------------------------------- /admin


@pytest.mark.parametrize("key", ["api:ide:ide-proj", "telegram:42", "cli:work", "api:work"])
def test_the_operator_reaches_any_session_as_given(key: str) -> None:
    assert resolve_session(OPERATOR, key) == key


def test_the_operator_is_refused_only_a_key_that_cannot_be_stored() -> None:
    assert refused(OPERATOR, "").status == 400
    assert refused(OPERATOR, "x" * 300).message.startswith("key:")


# --------------------------------------------------------------------------- any text


def _client_head(key: str) -> str | None:
    """The word of `api:<word>:...` a key starts with, folded as a person reads it."""
    rest = unicodedata.normalize("NFKC", key.removeprefix("api:")).casefold()
    word, colon, _ = rest.partition(":")
    return (
        word
        if colon and word and all(c.isascii() and (c.isalnum() or c in "-_") for c in word)
        else None
    )


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.text(max_size=40),
        st.builds(
            "".join,
            st.lists(
                st.sampled_from(
                    ["api", ":", "ide", "IDE", "default", "-", "\uff1a", "\uff49", "%3A", "x"]
                ),
                max_size=8,
            ),
        ),
    )
)
def test_no_text_leaves_its_callers_namespace(sent: str) -> None:
    """Whatever a caller sends: a SessionRefused, or a key of its own namespace. The chat
    token's key never reads (folded) as another client's `api:<client>:`, nor is its
    file one of another client's on a case-insensitive file system."""
    for caller in (CHAT_CALLER, IDE, DEFAULT_V1):
        try:
            key = resolve_session(caller, sent)
        except SessionRefused as exc:
            assert exc.status in (400, 403)
            continue
        stem = encode_key(key).casefold()
        if caller is CHAT_CALLER:
            assert key.startswith("api:")
            head = _client_head(key)
            assert head is None or key.startswith("api:default:"), key
            assert not stem.startswith("api%3aide%3a")
        else:
            assert key.startswith(f"api:{caller.client}:")
            assert stem.startswith(f"api%3a{caller.client}%3a")
