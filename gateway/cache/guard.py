"""The near-duplicate guard: a pure check that two similar questions ask the same thing.

Sentence embeddings score "turn on the lights" and "turn off the lights", or "capital of
France" and "capital of Germany", as near neighbours. A similarity threshold alone would
serve one as the answer to the other. `guard_conflict` is the veto applied after the
threshold: two questions may share an answer only if, after removing politeness and
question framing, expanding contractions and a light stemming, they have

- the same negations, numbers (digits or number words) and time words,
- no antonym pair split between them (on/off, enable/disable, before/after, ...),
- the same specific question words (who/when/where/why/which, how many/much/long/...),
- the same grammatical persons (my vs your vs his),
- the same content words (so a changed entity, unit or object never passes),
- the same objects for every preposition both use ("from Paris" vs "from London"),
- the same order of the content words outside prepositional phrases ("who killed
  Brutus" vs "who did Brutus kill").

Before those checks, a word that only one side has and that no English dictionary knows is
read as a misspelling of the other side's dictionary word one edit away with the same
first letter ("statment" / "statement"); two real words ("desert" / "dessert") never
are. Spoken fillers ("um", "uh") and thanks are dropped like politeness.

It errs towards "different": a false veto costs one LLM call, a false pass serves a
wrong answer.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "`": "'", "\u00b4": "'"})
_TOKEN = re.compile(r"\d+(?:[.,:]\d+)*|[^\W\d_]+(?:'[^\W\d_]+)?|[+\-*/=<>%$€£]")

_IS_AFTER = frozenset(
    {"what", "who", "where", "when", "why", "how", "which", "that", "it", "there", "he",
     "she", "here"}
)  # fmt: skip
_IRREGULAR_NOT = {"can't": "can not", "won't": "will not", "shan't": "shall not",
                  "ain't": "is not", "cannot": "can not"}  # fmt: skip
# Contractions typed without the apostrophe; ambiguous ones ("its", "were", "ill") are not here.
_BARE_CONTRACTIONS = {
    word.replace("'", ""): word
    for word in (
        "don't", "doesn't", "didn't", "can't", "won't", "isn't", "aren't", "wasn't",
        "weren't", "haven't", "hasn't", "hadn't", "wouldn't", "shouldn't", "couldn't",
        "what's", "how's", "where's", "who's", "that's", "there's", "i'm", "i've",
        "you're", "you've", "they're",
    )
}  # fmt: skip
_CONTRACTION_SUFFIXES = {"'re": "are", "'m": "am", "'ll": "will", "'ve": "have", "'d": "would"}

# Phrases that frame a question without changing what is asked, and what they become.
_HOW_TO = ("how", "to")
_REWRITES: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = tuple(
    sorted(
        [
            *(
                (tuple(p.split()), ())
                for p in (
                    "can you please tell me", "could you please tell me", "can you tell me",
                    "could you tell me", "would you tell me", "can you explain to me",
                    "could you explain to me", "can you explain", "could you explain",
                    "would you explain", "please explain", "please tell me", "explain to me",
                    "tell me", "i want to know", "i would like to know", "i wonder",
                    "do you know", "i need to know", "can you please", "could you please",
                    "can you", "could you", "would you", "quick question",
                    "i have a question", "to me", "thank you very much", "thank you so much",
                    "thanks so much", "thank you", "many thanks", "just wondering",
                    "i was wondering", "i am wondering",
                )
            ),
            *(
                (("how", *p.split()), _HOW_TO)
                for p in (
                    "do i", "can i", "could i", "should i", "would i", "do you", "can you",
                    "does one", "can one", "should one", "do we", "can we", "should we",
                )
            ),
            *(
                (tuple(p.split()), _HOW_TO)
                for p in (
                    "what is the best way to", "what is the easiest way to",
                    "what is a good way to", "what is the way to", "what is the proper way to",
                    "what is the correct way to", "what is the right way to",
                )
            ),
        ],
        key=lambda rewrite: -len(rewrite[0]),
    )
)  # fmt: skip

NEGATIONS = frozenset(
    {"not", "no", "never", "without", "none", "nobody", "nothing", "nowhere", "neither",
     "nor", "cannot", "non"}
)  # fmt: skip

_NUMBER_WORDS = {
    "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
    "seven": "7", "eight": "8", "nine": "9", "ten": "10", "eleven": "11", "twelve": "12",
    "thirteen": "13", "fourteen": "14", "fifteen": "15", "sixteen": "16",
    "seventeen": "17", "eighteen": "18", "nineteen": "19", "twenty": "20", "thirty": "30",
    "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80",
    "ninety": "90", "hundred": "100", "thousand": "1000", "million": "1000000",
    "billion": "1000000000", "dozen": "12", "half": "0.5", "quarter": "0.25",
    "twice": "2x", "once": "1x", "first": "1st", "third": "3rd", "fourth": "4th",
    "fifth": "5th", "single": "1", "double": "2x", "triple": "3x", "pair": "2",
}  # fmt: skip

TIME_WORDS = frozenset(
    {
        "today", "tomorrow", "yesterday", "tonight", "now", "currently", "current", "later",
        "soon", "recent", "recently", "latest", "ago", "last", "next", "previous",
        "weekend", "weekday", "morning", "afternoon", "evening", "night", "noon", "midnight",
        "am", "pm", "week", "month", "year", "decade", "century", "hour", "minute", "day",
        "monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday",
        "january", "february", "march", "april", "may", "june", "july", "august",
        "september", "october", "november", "december", "spring", "summer", "autumn",
        "fall", "winter", "daily", "weekly", "monthly", "yearly", "annual", "annually",
        "hourly", "early", "late", "before", "after", "since", "until", "past", "future",
    }
)  # fmt: skip


def _slash_pairs(text: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in text.split():
        left, right = item.split("/")
        pairs.append((left, right))
    return tuple(pairs)


ANTONYMS = _slash_pairs(
    "on/off enable/disable enabled/disabled open/close opened/closed start/stop "
    "begin/end start/end increase/decrease up/down in/out add/remove buy/sell "
    "import/export upload/download push/pull encrypt/decrypt encode/decode lock/unlock "
    "show/hide true/false yes/no win/lose left/right first/last above/below "
    "inside/outside more/less most/least max/min maximum/minimum high/low "
    "higher/lower highest/lowest hot/cold warm/cold best/worst pros/cons "
    "advantage/disadvantage connect/disconnect install/uninstall allow/deny "
    "allow/block accept/reject include/exclude input/output send/receive "
    "north/south east/west fast/slow faster/slower fastest/slowest cheap/expensive "
    "big/small large/small long/short positive/negative plus/minus add/subtract "
    "multiply/divide compress/decompress zip/unzip mute/unmute follow/unfollow "
    "subscribe/unsubscribe login/logout enter/exit arrive/depart rise/fall "
    "sunrise/sunset day/night male/female old/new young/old early/late easy/hard "
    "easy/difficult safe/dangerous legal/illegal possible/impossible like/dislike "
    "agree/disagree ascending/descending asc/desc visible/hidden public/private "
    "internal/external upper/lower uppercase/lowercase forward/backward front/back "
    "top/bottom horizontal/vertical inner/outer merge/split join/split attach/detach "
    "mount/unmount pause/resume read/write get/set create/delete insert/delete "
    "over/under before/after celsius/fahrenheit light/dark heat/cool heating/cooling "
    "wet/dry full/empty import/export mine/yours always/never all/none any/none "
    "min/max sum/difference to/from"
)

# "which" asks what "what" asks ("which/what city is the capital"), so it is not here.
QUESTION_WORDS = frozenset({"who", "whom", "whose", "when", "where", "why"})
_HOW_QUANTITY = frozenset(
    {"many", "much", "long", "old", "far", "often", "big", "tall", "large", "small",
     "fast", "high", "deep", "heavy", "soon", "late", "early"}
)  # fmt: skip

_PERSONS = {
    **dict.fromkeys(("i", "me", "my", "mine", "myself", "we", "us", "our", "ours"), "1st"),
    **dict.fromkeys(("you", "your", "yours", "yourself", "yourselves", "u", "ur"), "2nd"),
    **dict.fromkeys(("he", "him", "his", "himself"), "3rd-m"),
    **dict.fromkeys(("she", "her", "hers", "herself"), "3rd-f"),
    **dict.fromkeys(("they", "them", "their", "theirs", "themselves"), "3rd-p"),
}  # fmt: skip

PREPOSITIONS = frozenset(
    {"of", "in", "on", "at", "for", "from", "with", "by", "about", "into", "than", "vs",
     "versus", "over", "under", "between", "per", "near", "during", "since", "until",
     "before", "after", "without", "within", "through", "across", "around", "against",
     "among", "behind", "below", "above", "beyond", "inside", "outside", "via", "like",
     "to", "onto", "toward", "towards"}
)  # fmt: skip

# Words that carry no part of what is asked (after framers are gone).
_STOPWORDS = frozenset(
    {"a", "an", "the", "is", "are", "was", "were", "be", "been", "being", "do", "does",
     "did", "doing", "done", "can", "could", "would", "should", "will", "shall", "might",
     "must", "what", "how", "it", "its", "that", "these", "those", "there", "here", "some",
     "and", "or", "but", "so", "as", "if", "then", "also", "just", "please", "pls", "plz",
     "kindly", "exactly", "actually", "really", "basically", "briefly", "simply", "quite",
     "explain", "describe", "know", "way", "ways", "correct", "proper", "properly",
     "hi", "hello", "hey", "thanks", "thank", "ok", "okay", "well", "mean", "meaning",
     "define", "definition", "anyway", "again", "have", "has", "had", "get", "which",
     "got", "go", "s", "'s", "any", "thing", "things", "stuff", "possible", "somehow",
     "tell", "give", "show", "ever", "even", "very", "too",
     "um", "umm", "uh", "uhm", "erm", "er", "hmm", "yeah", "yep", "ah", "oh"}
)  # fmt: skip

_SYNONYMS = {
    "film": "movie", "films": "movie", "automobile": "car", "begin": "start",
    "commence": "start", "purchase": "buy", "largest": "biggest", "quickest": "fastest",
    "repair": "fix", "photo": "picture", "photograph": "picture", "modify": "change",
    "alter": "change", "erase": "delete", "sum": "total", "couch": "sofa",
    "lengthy": "long", "kid": "child", "kids": "child",
    "children": "child", "folder": "directory", "dir": "directory", "app": "application",
    "programme": "program", "colour": "color", "favourite":
    "favorite", "centre": "center", "metre": "meter", "litre": "liter", "utilize": "use",
    "utilise": "use", "create": "make", "build": "make", "construct": "make",
    "dict": "dictionary", "quickly": "fast", "quick": "fast", "rapidly": "fast",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Analysis:
    negations: Counter[str]
    numbers: Counter[str]
    time_words: frozenset[str]
    question_words: frozenset[str]
    persons: frozenset[str]
    words: frozenset[str]  # every token, for the antonym check
    content: Counter[str]
    objects: dict[str, Counter[frozenset[str]]]  # preposition -> the phrases it governs
    order: tuple[str, ...]  # content words outside prepositional phrases, in order


def _expand(token: str) -> list[str]:
    token = _BARE_CONTRACTIONS.get(token, token)
    if token in _IRREGULAR_NOT:
        return _IRREGULAR_NOT[token].split()
    if token.endswith("n't"):
        return [token[:-3], "not"]
    if "'" in token:
        head, _, tail = token.partition("'")
        if tail == "s":
            return [head, "is"] if head in _IS_AFTER else [head]
        if "'" + tail in _CONTRACTION_SUFFIXES:
            return [head, _CONTRACTION_SUFFIXES["'" + tail]]
        return [head + tail]
    return [token]


def _tokens(text: str) -> list[str]:
    folded = unicodedata.normalize("NFKC", text).translate(_APOSTROPHES).casefold()
    out: list[str] = []
    for raw in _TOKEN.findall(folded):
        out.extend(_expand(raw))
    return _rewrite(out)


def _rewrite(tokens: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(tokens):
        for pattern, replacement in _REWRITES:
            if tuple(tokens[i : i + len(pattern)]) == pattern:
                out.extend(replacement)
                i += len(pattern)
                break
        else:
            out.append(tokens[i])
            i += 1
    return out


def _stem(word: str) -> str:
    """A deliberately small stemmer (plural, then -ing/-ed/-ly, then a final -e or -y),
    with a few synonyms folded together. It only has to map both sides alike."""
    word = _SYNONYMS.get(word, word)
    if word.endswith("ies") and len(word) > 4:
        word = word[:-3] + "i"
    elif word.endswith("sses") or (
        word.endswith(("ches", "shes", "xes", "zes", "oes")) and len(word) > 5
    ):
        word = word[:-2]
    elif word.endswith("s") and not word.endswith(("ss", "us", "is")) and len(word) > 3:
        word = word[:-1]
    word = _SYNONYMS.get(word, word)
    for suffix in ("ing", "ed", "ly"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[: -len(suffix)]
            break
    if word.endswith("e") and len(word) > 3:
        word = word[:-1]
    elif word.endswith("y") and len(word) > 3:
        word = word[:-1] + "i"
    return word


def _is_number(token: str) -> bool:
    return token[0].isdigit()


@cache
def load_dictionary() -> tuple[Callable[[str], bool], Callable[[str], set[str]]] | None:
    """(is_known_word, words_one_edit_away) from pyspellchecker's English word list, or
    None without it (then no word is read as a misspelling: stricter, never looser).
    The first call reads the list from disk (about a second): call it from a thread."""
    try:
        from spellchecker import SpellChecker
    except ImportError:
        return None
    checker = SpellChecker(language="en", distance=1)
    return (lambda word: word in checker), checker.edit_distance_1


def _typo_candidate(word: str) -> bool:
    return len(word) >= 4 and word.isalpha()


def _correct_typos(a: list[str], b: list[str]) -> list[str]:
    """`b` with each misspelling of a word of `a` replaced by that word (and the reverse
    direction handled by calling it the other way round). A replacement needs a word of `b`
    that `a` lacks and the dictionary does not know, and exactly one word that only `a`
    has, which the dictionary knows, one edit away, with the same first letter."""
    only_a = {w for w in set(a) - set(b) if _typo_candidate(w)}
    only_b = {w for w in set(b) - set(a) if _typo_candidate(w)}
    if not only_a or not only_b:
        return b
    dictionary = load_dictionary()
    if dictionary is None:
        return b
    known, one_edit = dictionary
    fixes: dict[str, str] = {}
    for word in only_b:
        if known(word):
            continue
        near = one_edit(word)
        matches = [w for w in only_a if w[0] == word[0] and w in near and known(w)]
        if len(matches) == 1:
            fixes[word] = matches[0]
    return [fixes.get(w, w) for w in b] if fixes else b


def _analyse(tokens: list[str]) -> _Analysis:
    negations: Counter[str] = Counter()
    numbers: Counter[str] = Counter()
    time_words: set[str] = set()
    question_words: set[str] = set()
    persons: set[str] = set()
    content: Counter[str] = Counter()
    phrases: list[tuple[str, set[str]]] = []
    order: list[str] = []
    # The preposition whose noun phrase is being read: it runs over leading function
    # words ("of the ...") and ends at the first function word after a content word.
    governing: str | None = None
    phrase_started = False

    for i, token in enumerate(tokens):
        if token in TIME_WORDS:
            time_words.add(token)
        if token in NEGATIONS:  # before prepositions: "without" is both
            negations["not" if token in {"not", "cannot", "non"} else token] += 1
        if token in PREPOSITIONS:
            governing, phrase_started = token, False
            phrases.append((token, set()))
            continue
        if token in _STOPWORDS or token in _PERSONS or token in QUESTION_WORDS:
            if token in _PERSONS:
                persons.add(_PERSONS[token])
            elif token in QUESTION_WORDS:
                question_words.add(token)
            if phrase_started:
                governing = None
            continue
        if token in NEGATIONS or _is_number(token) or token in _NUMBER_WORDS:
            if token not in NEGATIONS:
                numbers[_NUMBER_WORDS.get(token, token.replace(",", ""))] += 1
            if phrase_started:
                governing = None
            continue
        if not token[0].isalnum():
            numbers[token] += 1  # operators and currency signs change the question
            governing = None
            continue
        if token == "how" and i + 1 < len(tokens) and tokens[i + 1] in _HOW_QUANTITY:
            question_words.add("how " + tokens[i + 1])
        stem = _stem(token)
        content[stem] += 1
        if governing is not None:
            phrases[-1][1].add(stem)
            phrase_started = True
        else:
            order.append(stem)

    return _Analysis(
        negations=negations,
        numbers=numbers,
        time_words=frozenset(time_words),
        question_words=frozenset(question_words),
        persons=frozenset(persons),
        words=frozenset(tokens),
        content=content,
        objects={
            p: Counter(frozenset(words) for q, words in phrases if q == p) for p, _ in phrases
        },
        order=tuple(order),
    )


def _antonym_split(a: frozenset[str], b: frozenset[str]) -> tuple[str, str] | None:
    for x, y in ANTONYMS:
        for left, right in ((a, b), (b, a)):
            if x in left and y in right and x not in right and y not in left:
                return x, y
    return None


def guard_conflict(a: str, b: str) -> str | None:
    """Why questions `a` and `b` must not share an answer, or None if nothing says so."""
    tokens_a, tokens_b = _tokens(a), _tokens(b)
    tokens_b = _correct_typos(tokens_a, tokens_b)
    tokens_a = _correct_typos(tokens_b, tokens_a)
    x, y = _analyse(tokens_a), _analyse(tokens_b)
    if x.negations != y.negations:
        return "negation differs"
    if x.numbers != y.numbers:
        return "numbers differ"
    if x.time_words != y.time_words:
        return "time words differ"
    split = _antonym_split(x.words, y.words)
    if split is not None:
        return f"antonyms {split[0]}/{split[1]}"
    if x.question_words != y.question_words:
        return "question words differ"
    if x.persons != y.persons:
        return "grammatical person differs"
    if x.content != y.content:
        return "content words differ"
    for preposition in x.objects.keys() & y.objects.keys():
        if x.objects[preposition] != y.objects[preposition]:
            return f"object of '{preposition}' differs"
    both = set(x.order) & set(y.order)
    if [w for w in x.order if w in both] != [w for w in y.order if w in both]:
        return "word order differs"
    return None
