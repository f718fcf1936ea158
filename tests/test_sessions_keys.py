"""Session key encoding: reversible, collision-free, and always a plain file name."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.sessions import SessionKeyError, decode_key, encode_key, session_path
from gateway.sessions.keys import MAX_STEM_BYTES, key_from_filename

# Text without lone surrogates (those are rejected, tested separately), biased towards
# the characters that matter for paths.
_tricky = st.sampled_from(["/", "\\", ".", "..", "\0", "%", "_", ":", " ", "~", "é", "日", "🙂"])
keys = (
    st.lists(
        st.one_of(_tricky, st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=8)),
        min_size=1,
        max_size=12,
    )
    .map("".join)
    .filter(lambda k: k != "" and len(encode_key_or_none(k) or "x" * 999) <= 200)
)


def encode_key_or_none(key: str) -> str | None:
    try:
        return encode_key(key)
    except SessionKeyError:
        return None


@given(keys)
def test_round_trip(key: str) -> None:
    assert decode_key(encode_key(key)) == key


@given(keys, keys)
def test_injective(a: str, b: str) -> None:
    if a != b:
        assert encode_key(a) != encode_key(b)


@given(keys)
def test_path_is_directly_inside_sessions_dir(key: str) -> None:
    base = Path("/srv/gateway/sessions")
    path = session_path(base, key)
    assert path.parent == base
    assert "/" not in path.name and "\0" not in path.name
    assert path.name not in (".", "..")
    assert path.resolve().parent == base.resolve()
    assert set(encode_key(key)) <= set(
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-%"
    )
    assert key_from_filename(path.name) == key


def test_examples_that_used_to_collide() -> None:
    assert encode_key("telegram:1") == "telegram%3A1"
    assert encode_key("telegram_1") == "telegram_1"
    assert encode_key("a%3A") == "a%253A"  # the escape character itself is escaped
    assert encode_key("../../etc/passwd") == "..%2F..%2Fetc%2Fpasswd"
    assert encode_key("é") == "%C3%A9"


def test_rejects_unusable_keys() -> None:
    with pytest.raises(SessionKeyError, match="non-empty"):
        encode_key("")
    with pytest.raises(SessionKeyError, match="surrogate"):
        encode_key("bad\udc80key")
    with pytest.raises(SessionKeyError, match="too long"):
        encode_key("x" * (MAX_STEM_BYTES + 1))
    with pytest.raises(SessionKeyError, match="too long"):
        encode_key(":" * 67)  # 201 bytes once escaped
    assert encode_key("x" * MAX_STEM_BYTES)
    assert issubclass(SessionKeyError, ValueError)


@pytest.mark.parametrize(
    "stem", ["", "a%3a", "a%3", "a%ZZ", "a:b", "%41", "a b", "%C3", "é", "a%2"]
)
def test_decode_rejects_non_canonical_stems(stem: str) -> None:
    with pytest.raises(SessionKeyError):
        decode_key(stem)


def test_key_from_filename_ignores_other_files() -> None:
    assert key_from_filename("telegram%3A1.jsonl") == "telegram:1"
    assert key_from_filename(".jsonl") is None
    assert key_from_filename("x.jsonl.torn-20250101T000000Z") is None
    assert key_from_filename("x.jsonl.corrupt-1") is None
    assert key_from_filename("bad%zz.jsonl") is None
