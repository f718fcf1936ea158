"""Text policies shared by memory search and deduplication: tokens, stems, normal forms.

Everything here is a pure function. Two promises matter to callers:
- `tokenize` is deterministic and applied identically to documents and queries, so a
  document always matches a query made of its own words.
- Negations ("not", "no", "never", and "n't" contractions) are never dropped as
  stopwords: "likes rust" and "doesn't like rust" never normalize to the same thing.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

# A word is a run of letters or digits (any script); an apostrophe inside a word keeps
# it whole so contractions can be handled ("don't", "user's").
_WORD_RE = re.compile(r"[^\W_]+(?:['\u2019][^\W_]+)*")
_SPACE_RE = re.compile(r"\s+")
# A text `one_line` leaves as it is: words with single spaces between them.
_FOLDED_RE = re.compile(r"\S+(?: \S+)*")
# `_WORD_RE` on casefolded ASCII text (where it can only match these), a third faster.
_ASCII_WORD_RE = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*")

NEGATIONS: frozenset[str] = frozenset(
    {"not", "no", "never", "nor", "none", "nothing", "neither", "without", "cannot"}
)

# Deliberately small: function words that carry no topic. Negations are not in it.
_STOPWORD_LIST = """
    a an the and or but if then else so of at by for with about against between into
    through during before after above below to from up down in out on off over under
    again further once here there when where why how all any both each few more most
    other some such only own same than too very s t can will just should now i me my
    myself we our ours ourselves you your yours yourself yourselves he him his himself
    she her hers herself it its itself they them their theirs themselves what which who
    whom this that these those am is are was were be been being have has had having do
    does did doing would could shall may might must also as
"""
STOPWORDS: frozenset[str] = frozenset(_STOPWORD_LIST.split())


def normalize_text(text: str) -> str:
    """Unicode-normalize (NFKC), casefold and collapse whitespace; strip the ends.

    The normal form used for content hashes: two texts that differ only in case,
    width/compatibility forms or spacing get the same normal form.
    """
    if not text.isascii():
        text = unicodedata.normalize("NFKC", text)
    text = text.casefold()
    return text if _FOLDED_RE.fullmatch(text) else _SPACE_RE.sub(" ", text).strip()


def one_line(text: str) -> str:
    """Collapse every run of whitespace (newlines included) into one space."""
    # Most texts are one line already: a check, a quarter of the cost of rebuilding them.
    return text if _FOLDED_RE.fullmatch(text) else _SPACE_RE.sub(" ", text).strip()


def _raw_words(text: str) -> list[str]:
    """`_WORD_RE`'s matches in the casefolded NFKC text (ASCII text: a third faster)."""
    if text.isascii():
        return _ASCII_WORD_RE.findall(text.lower())
    return _WORD_RE.findall(unicodedata.normalize("NFKC", text).casefold())


def words(text: str) -> list[str]:
    """Casefolded words of `text`, contractions resolved, nothing removed or stemmed.

    "n't" contractions become "not" ("doesn't" -> "not": the auxiliary is a stopword
    anyway); other apostrophe suffixes are dropped ("user's" -> "user").
    """
    found = _raw_words(text)
    if "'" not in text and "\u2019" not in text:
        return found  # no contraction to resolve
    out: list[str] = []
    for word in found:
        if "'" in word or "\u2019" in word:
            word = word.replace("\u2019", "'")
            if word.endswith("n't"):
                if word in ("can't", "won't"):
                    out.append("can" if word == "can't" else "will")
                out.append("not")
                continue
            word = word.split("'", 1)[0]
        out.append(word)
    return out


@lru_cache(maxsize=65_536)
def stem(word: str) -> str:
    """A light English suffix stripper (plurals, -ing, -ed, final -e).

    Not Porter: it only aims to make "decisions"/"decision", "deploying"/"deployed"/
    "deploy" and "databases"/"database" meet. Short words and non-ASCII words are
    returned unchanged, so it never mangles names in other scripts.
    """
    if len(word) <= 3 or not word.isascii() or not word.isalpha():
        return word
    if word.endswith("ies") and len(word) > 4:
        word = word[:-3] + "y"
    elif word.endswith("sses"):
        word = word[:-2]
    elif word.endswith("s") and not word.endswith(("ss", "us", "is")):
        word = word[:-1]
    if word.endswith("ing") and len(word) > 5:
        word = _undouble(word[:-3])
    elif word.endswith("ed") and len(word) > 4:
        word = _undouble(word[:-2])
    if word.endswith("e") and len(word) > 4:
        word = word[:-1]
    return word


def _undouble(word: str) -> str:
    # "dropp" -> "drop", "runn" -> "run"; keep "ll"/"ss"/"zz" ("install", "pass").
    if len(word) > 3 and word[-1] == word[-2] and word[-1] not in "aeiouylsz":
        return word[:-1]
    return word


def tokenize(text: str) -> list[str]:
    """Search tokens: casefolded words minus stopwords, lightly stemmed, in order."""
    return [stem(w) for w in words(text) if w not in STOPWORDS]
