"""Recall quality of memory search on public long conversations (LoCoMo, development half).

Run `.venv/bin/python bench/recall.py` (a table), `--json` (the same numbers as JSON) or
`--quick` (two conversations). The data is `../shared/data/locomo-dev/` (override with
`--data`): five LoCoMo conversations whose questions cite the turns (`dia_id`s) that
hold their answers. The other half of LoCoMo is kept apart to judge the result; nothing
here may be tuned to it.

What is judged, per layer, each searched with the question as the query:
- facts: the observations LoCoMo extracted per turn, written as MEMORY.md facts (one
  `- [learned_fact] text` bullet each, under the session's day, with the turn it cites
  as its origin, as consolidation records the message a fact came from). "ours" is the
  per-turn recall the agent uses (`relevant_memory`, top 8: the facts' own ranks fused
  with their origin messages' ranks in message search). A fact hits when the turn it
  cites is one of the question's evidence turns.
- messages: every turn as one message (`Speaker: text`, an image's caption appended),
  as the message index holds them ("ours"; "ours+dense": with wordllama's similarity
  fused in, as `MessageIndex` does when given a dense index). A message hits when it
  is an evidence turn.
- sessions: the sessions ranked by history search over their summaries (one HISTORY.md
  line each, stamped with the session's time; "ours"), and by their best messages
  (`MessageIndex.rank_sessions`; "ours-msgs"). A session hits when an evidence turn is
  in it; `all@k` is whether every evidence session is in the top k.
- recall: the per-turn memory block (`recall_lines`: facts, summaries and messages
  blended, 8 from each layer); a line hits when it is a fact citing an evidence turn
  or an evidence message (summaries stand for no turn).

Each layer is searched by ours, by `rank_bm25` (BM25Okapi over lowercase words, the
usual baseline) and by plain dense retrieval (wordllama's static embeddings, cosine),
in the same run, over the same documents.

Metrics (per question, averaged): `hit@k` (an evidence unit in the top k), `all@k`
(every evidence unit in the top k), `R@k` (the share of evidence units in the top k).
"all" aggregates categories 1-4; category 5 (adversarial: the answer is not in the
conversation) is shown on its own. Latency is CPU per query (`time.process_time`: the
machine is shared), in microseconds, the query's vector computed before (the agent loop
computes it once a turn for the cache and the recall: 1.0-1.4 ms); memory is the index's
size (ours: the index's own estimate; rank_bm25: bytes allocated while it is built;
dense: the matrix, without the model's weights shared by all indexes).

Issue 41's trials (`--trials all`, on facts, messages and the blended recall): "ours+facts"
indexes each message also under the facts drawn from it (LoCoMo's observations, each
citing its turn, as consolidation records a fact's origin message); "+minilm" fuses
all-MiniLM-L6-v2's sign codes (`DenseIndex(..., bits=384)`); "+time" ranks the messages in
the time range a question names higher (`gateway.memory.timewords`, read against the day
after the last session). Results and command: bench/results/recall-i41.md.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loguru import logger

from gateway.agent.memory_tools import recall_lines, recall_time, relevant_memory
from gateway.memory import MemoryManager
from gateway.memory.dense import SENTENCE_FLOOR, DenseIndex, StaticEmbedder, sentence_embedder
from gateway.memory.facts import NewFact, Origin
from gateway.memory.format import parse_fact
from gateway.memory.messages import (
    DENSE_WEIGHT,
    FUSION_DEPTH,
    TIME_WEIGHT,
    MessageIndex,
    StoredMessage,
)
from gateway.memory.text import normalize_text

DEFAULT_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "locomo-dev"
RECALL_LIMIT = 8  # what the agent's memory block takes per turn
DEPTH = 10
CATEGORY_NAMES = {
    1: "multi-hop",
    2: "temporal",
    3: "open-domain",
    4: "single-hop",
    5: "adversarial",
}
_DIA_RE = re.compile(r"D(\d+):(\d+)")
_WORD_RE = re.compile(r"\w+")


# -- the data --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    dia_id: str
    session: int
    speaker: str
    text: str
    when: datetime


@dataclass(frozen=True, slots=True)
class Question:
    text: str
    category: int
    evidence: frozenset[str]  # dia_ids


@dataclass(slots=True)
class Conversation:
    name: str
    turns: list[Turn] = field(default_factory=list)
    facts: list[tuple[str, str, datetime]] = field(default_factory=list)  # text, dia_id, when
    summaries: list[tuple[int, str, datetime]] = field(default_factory=list)  # session, text
    questions: list[Question] = field(default_factory=list)


def parse_when(text: str) -> datetime:
    """LoCoMo's `1:56 pm on 8 May, 2023` as a UTC datetime."""
    return datetime.strptime(text.strip(), "%I:%M %p on %d %B, %Y").replace(tzinfo=UTC)


def load_conversation(path: Path) -> Conversation:
    data = json.loads(path.read_text())
    conv = Conversation(path.stem)
    sessions = sorted(
        int(m.group(1)) for k in data if (m := re.fullmatch(r"session_(\d+)", k)) is not None
    )
    known: set[str] = set()
    for number in sessions:
        when = parse_when(data[f"session_{number}_date_time"])
        for turn in data[f"session_{number}"]:
            text = turn["text"]
            if turn.get("blip_caption"):
                text += f" [shared an image: {turn['blip_caption']}]"
            conv.turns.append(Turn(turn["dia_id"], number, turn["speaker"], text, when))
            known.add(turn["dia_id"])
        for facts in data.get(f"session_{number}_observation", {}).values():
            for text, dia_id in facts:
                for cited in _DIA_RE.findall(str(dia_id)) or []:
                    conv.facts.append((text, f"D{cited[0]}:{cited[1]}", when))
        summary = data.get(f"session_{number}_summary")
        if summary:
            conv.summaries.append((number, summary, when))
    for qa in data["qa"]:
        evidence = frozenset(
            f"D{a}:{b}" for item in qa.get("evidence", []) for a, b in _DIA_RE.findall(item)
        )
        evidence &= known
        if evidence:
            conv.questions.append(Question(qa["question"], int(qa["category"]), evidence))
    return conv


#: A distinct fact: its text, its session's time, and the turn it cites first (its origin).
FactRow = tuple[str, datetime, str]


def session_of(dia_id: str) -> int:
    return int(dia_id[1:].split(":", 1)[0])


# -- the systems -----------------------------------------------------------------------


class Retriever:
    """Top-k documents (indexes into the layer's document list) for a query."""

    name = ""
    memory = 0

    def search(self, query: str, k: int) -> list[int]:
        raise NotImplementedError


def stored_messages(turns: Sequence[Turn]) -> dict[str, list[StoredMessage]]:
    """The turns as the message index reads them from sessions, per session."""
    sessions: dict[str, list[StoredMessage]] = {}
    for i, t in enumerate(turns):
        sid = f"S{t.session}"
        message = StoredMessage("locomo", sid, str(i), t.when.timestamp(), t.speaker, message_of(t))
        sessions.setdefault(sid, []).append(message)
    return sessions


def message_of(turn: Turn) -> str:
    return f"{turn.speaker}: {turn.text}"


class OursMessages(Retriever):
    """The message index (`gateway.memory.messages`), as `conversation_search` uses it."""

    name = "ours"

    def __init__(self, turns: Sequence[Turn]) -> None:
        self.index = MessageIndex()
        for sid, messages in stored_messages(turns).items():
            self.index.add(sid, messages)
        self.memory = self.index.memory_bytes()

    def search(self, query: str, k: int) -> list[int]:
        return [int(hit.entry_id) for hit in self.index.search(query, k, context=False)]


@dataclass(frozen=True, slots=True)
class Recipe:
    """What the product's recall is given, trial by trial (issue 41): messages indexed
    under the facts drawn from them (`facts`), MiniLM's sign codes fused in with the
    query's vector computed once (`dense`), the time range a question names ranking its
    messages higher (`time`)."""

    facts: bool = False
    dense: bool = False
    time: bool = False

    @property
    def name(self) -> str:
        parts = [
            n
            for n, on in (("facts", self.facts), ("minilm", self.dense), ("time", self.time))
            if on
        ]
        return "+".join(["ours", *parts])


#: The trials `--trials` runs (each on facts and messages).
TRIALS = {
    "facts": Recipe(facts=True),
    "minilm": Recipe(dense=True),
    "time": Recipe(time=True),
    "facts+minilm": Recipe(facts=True, dense=True),
    "facts+time": Recipe(facts=True, time=True),
    "facts+minilm+time": Recipe(facts=True, dense=True, time=True),
}

#: The question's unit vector, computed once per question before anything is timed (the
#: agent loop computes it once a turn and shares it with the cache).
QUERY_VECTORS: dict[str, Any] = {}


class _Remembered:
    """The sentence model with its vectors kept by text: the bench builds an index per
    trial over the same messages (a text always maps to the same vector), and the scale
    rows repeat LoCoMo's turns."""

    def __init__(self, embedder: Any) -> None:
        self._embedder = embedder
        self.model_id = embedder.model_id
        self._known: dict[str, Any] = {}

    def embed(self, texts: Sequence[str]) -> Any:
        import numpy as np

        missing = [t for t in dict.fromkeys(texts) if t not in self._known]
        if missing:
            for text, row in zip(missing, self._embedder.embed(missing), strict=True):
                self._known[text] = row
        return np.stack([self._known[t] for t in texts]) if texts else np.zeros((0, 384))


_REMEMBERED: list[_Remembered] = []


def bench_embedder() -> _Remembered:
    if not _REMEMBERED:
        embedder = sentence_embedder()
        assert embedder is not None, "the embedding extra is needed for the minilm trials"
        _REMEMBERED.append(_Remembered(embedder))
    return _REMEMBERED[0]


def query_vector(query: str) -> Any:
    vector = QUERY_VECTORS.get(query)
    if vector is None:
        embedder = sentence_embedder()
        assert embedder is not None, "the embedding extra is needed for the minilm trials"
        vector = QUERY_VECTORS[query] = embedder.embed([query])[0]
    return vector


def recipe_index(turns: Sequence[Turn], recipe: Recipe, manager: MemoryManager) -> MessageIndex:
    """The message index as the product builds it for `recipe`, every message embedded
    (the background pass, run here to its end)."""
    dense = DenseIndex(bench_embedder(), bits=384, floor=SENTENCE_FLOOR) if recipe.dense else None
    index = MessageIndex(dense=dense, fact_keys=manager.fact_keys if recipe.facts else None)
    index.embed_in_background = False
    index.time_weight = TIME_WEIGHT if recipe.time else 0.0
    for sid, messages in stored_messages(turns).items():
        index.add(sid, messages)
    index.embed_pending()
    return index


class OursHybrid(OursMessages):
    """The message index with dense ranks fused in (`gateway.memory.dense`)."""

    name = "ours+dense"
    _embedder: StaticEmbedder | None = None

    def __init__(self, turns: Sequence[Turn], weight: float = DENSE_WEIGHT) -> None:
        if OursHybrid._embedder is None:
            OursHybrid._embedder = StaticEmbedder()
        self.index = MessageIndex(dense=DenseIndex(OursHybrid._embedder), dense_weight=weight)
        for sid, messages in stored_messages(turns).items():
            self.index.add(sid, messages)
        self.memory = self.index.memory_bytes()


class OursSessionsByMessages(Retriever):
    """Sessions ranked by their best messages (`MessageIndex.rank_sessions`)."""

    name = "ours-msgs"

    def __init__(self, turns: Sequence[Turn], sessions: Sequence[int]) -> None:
        self.messages = OursMessages(turns)
        self.position = {f"S{s}": i for i, s in enumerate(sessions)}
        self.memory = self.messages.memory

    def search(self, query: str, k: int) -> list[int]:
        ranked = self.messages.index.rank_sessions(query, k)
        return [self.position[s] for s in ranked if s in self.position]


class OursRecall(Retriever):
    """The per-turn memory block's lines (`recall_lines`): facts, summaries and messages
    blended; a result stands for the fact's turns or the message's turn."""

    name = "ours"

    def __init__(
        self,
        root: Path,
        conv: Conversation,
        fact_rows: Sequence[FactRow],
        recipe: Recipe = Recipe(),
    ) -> None:
        summaries = [(text, when) for _, text, when in conv.summaries]
        self.facts = OursFacts(root, fact_rows, conv.turns, summaries, recipe)
        self.name = recipe.name
        self.manager = self.facts.manager
        self.by_message = {message_of(t): i for i, t in enumerate(conv.turns)}
        self.fact_count = len(fact_rows)
        self.memory = self.facts.memory

    def search(self, query: str, k: int) -> list[int]:
        out: list[int] = []
        lines = recall_lines(
            self.manager,
            query,
            limit=RECALL_LIMIT,
            query_vector=self.facts.vector(query),
            now=self.facts.now,
        )
        for line in lines:
            if line.startswith("[earlier message, "):
                pos = self.by_message.get(line.split("] ", 1)[1])
                if pos is not None:
                    out.append(self.fact_count + pos)
                continue
            parsed = parse_fact(f"- {line}")
            text = parsed.text if parsed is not None else line
            fact = self.facts.positions.get(normalize_text(text))
            if fact is not None:
                out.append(fact)
        return out


class OursFacts(Retriever):
    """The agent's per-turn recall over MEMORY.md facts (`relevant_memory`), each fact
    written with its origin (the turn it cites, as consolidation records the message a
    fact came from) and the turns in the message index; with `summaries`, HISTORY.md
    holds them too (for the blended recall)."""

    name = "ours"

    def __init__(
        self,
        root: Path,
        facts: Sequence[FactRow],
        turns: Sequence[Turn],
        summaries: Sequence[tuple[str, datetime]] = (),
        recipe: Recipe = Recipe(),
    ) -> None:
        self.recipe = recipe
        self.name = recipe.name
        # The questions are asked after the last session: relative time words read so.
        self.now = max(t.when for t in turns) + timedelta(days=1)
        self.when = datetime.now(UTC)
        self.manager = MemoryManager(root, "locomo", clock=lambda: self.when)
        entry_of = {t.dia_id: str(i) for i, t in enumerate(turns)}
        by_day: dict[date, list[NewFact]] = {}
        for text, when, dia in facts:
            origin = Origin("locomo", entry_of[dia]) if dia in entry_of else None
            by_day.setdefault(when.date(), []).append(NewFact("learned_fact", text, origin))
        for day, items in sorted(by_day.items()):
            self.manager.append_facts(items, day=day)
        for text, when in summaries:
            self.when = when
            self.manager.append_history(text)
        self.manager.load_indexes()
        self.manager.messages = recipe_index(turns, recipe, self.manager)
        self.positions: dict[str, int] = {}
        for i, (text, _, _) in enumerate(facts):
            self.positions.setdefault(normalize_text(text), i)
        index = self.manager._memory_index.current()  # the bench measures it
        facts_memory = index.memory_bytes() if index is not None else 0
        self.memory = facts_memory + self.manager.messages.memory_bytes()

    def vector(self, query: str) -> Any:
        return query_vector(query) if self.recipe.dense else None

    def search(self, query: str, k: int) -> list[int]:
        out: list[int] = []
        found = relevant_memory(
            self.manager, query, limit=k, query_vector=self.vector(query), now=self.now
        )
        for line in found:
            parsed = parse_fact(f"- {line}")
            text = parsed.text if parsed is not None else line
            pos = self.positions.get(normalize_text(text))
            if pos is not None:
                out.append(pos)
        return out


class OursRecipeMessages(OursFacts):
    """Message search as the per-turn recall runs it (`recall_lines`' first search: the
    question's vector, the time range it names), over the index built for a recipe."""

    def search(self, query: str, k: int) -> list[int]:
        hits = self.manager.search_messages(
            query,
            k,
            context=False,
            query_vector=self.vector(query),
            during=recall_time(query, self.now),
        )
        return [int(hit.entry_id) for hit in hits]


class OursHistory(Retriever):
    """History search over session summaries (HISTORY.md lines), relevance only."""

    name = "ours"

    def __init__(self, root: Path, summaries: Sequence[tuple[str, datetime]]) -> None:
        self._when = summaries[0][1] if summaries else datetime.now(UTC)
        self.manager = MemoryManager(root, "locomo-history", clock=lambda: self._when)
        self.positions: dict[str, int] = {}
        for i, (text, when) in enumerate(summaries):
            self._when = when
            line = self.manager.append_history(text)
            self.positions[line] = i
        self.manager.load_indexes()
        index = self.manager._history_index.current()
        self.memory = index.memory_bytes() if index is not None else 0

    def search(self, query: str, k: int) -> list[int]:
        lines = self.manager.search_history(query, k, decay_rate=0.0)
        return [self.positions[line] for line in lines if line in self.positions]


def plain_words(text: str) -> list[str]:
    return _WORD_RE.findall(text.lower())


class RankBM25(Retriever):
    name = "rank_bm25"

    def __init__(self, docs: Sequence[str]) -> None:
        from rank_bm25 import BM25Okapi

        tracemalloc.start()
        self.bm25 = BM25Okapi([plain_words(d) for d in docs])
        self.memory = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()

    def search(self, query: str, k: int) -> list[int]:
        import numpy as np

        scores = self.bm25.get_scores(plain_words(query))
        return [int(i) for i in np.argsort(-scores, kind="stable")[:k]]


class Dense(Retriever):
    name = "dense"
    _embedder: Any = None

    def __init__(self, docs: Sequence[str]) -> None:
        if Dense._embedder is None:
            from gateway.cache.neardup import WordLlamaEmbedder

            Dense._embedder = WordLlamaEmbedder()
        self.matrix = Dense._embedder.embed(list(docs))
        self.memory = int(self.matrix.nbytes)

    def search(self, query: str, k: int) -> list[int]:
        import numpy as np

        scores = self.matrix @ Dense._embedder.embed([query])[0]
        top = np.argpartition(-scores, min(k, len(scores) - 1))[:k]
        return [int(i) for i in top[np.argsort(-scores[top], kind="stable")]]


# -- judging ---------------------------------------------------------------------------


@dataclass(slots=True)
class Score:
    """Per-question outcomes of one system on one layer."""

    hits8: list[float] = field(default_factory=list)
    r5: list[float] = field(default_factory=list)
    r10: list[float] = field(default_factory=list)
    all5: list[float] = field(default_factory=list)
    all10: list[float] = field(default_factory=list)

    def add(self, ranked: list[set[str]], evidence: frozenset[str]) -> None:
        """`ranked`: the evidence units each result stands for, best first."""

        def covered(k: int) -> set[str]:
            found: set[str] = set()
            for units in ranked[:k]:
                found |= units
            return found & evidence

        self.hits8.append(float(bool(covered(RECALL_LIMIT))))
        self.r5.append(len(covered(5)) / len(evidence))
        self.r10.append(len(covered(10)) / len(evidence))
        self.all5.append(float(covered(5) == evidence))
        self.all10.append(float(covered(10) == evidence))

    def extend(self, other: Score) -> None:
        for name in ("hits8", "r5", "r10", "all5", "all10"):
            getattr(self, name).extend(getattr(other, name))

    def summary(self) -> dict[str, float]:
        def mean(values: list[float]) -> float:
            return round(100 * statistics.fmean(values), 1) if values else float("nan")

        return {
            "n": len(self.hits8),
            "hit@8": mean(self.hits8),
            "R@5": mean(self.r5),
            "R@10": mean(self.r10),
            "all@5": mean(self.all5),
            "all@10": mean(self.all10),
        }


@dataclass(slots=True)
class Result:
    layer: str
    system: str
    group: str  # "all", a category name, or "conv <name>"
    n: int
    hit8: float
    r5: float
    r10: float
    all5: float
    all10: float
    p50_us: float | None = None
    p99_us: float | None = None
    memory_kb: float | None = None


@dataclass(slots=True)
class Run:
    """One system on one layer over all conversations."""

    layer: str
    system: str
    by_category: dict[int, Score] = field(default_factory=dict)
    by_conv: dict[str, Score] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    memory: list[int] = field(default_factory=list)


def judge(
    run: Run,
    conv: Conversation,
    retriever: Retriever,
    units: Callable[[int], set[str]],
    evidence_of: Callable[[Question], frozenset[str]],
) -> None:
    run.memory.append(retriever.memory)
    conv_score = run.by_conv.setdefault(conv.name, Score())
    for question in conv.questions:
        start = time.process_time()  # CPU: the machine is shared, waiting does not count
        ranked = retriever.search(question.text, DEPTH)
        run.latencies.append(time.process_time() - start)
        score = Score()
        score.add([units(i) for i in ranked], evidence_of(question))
        run.by_category.setdefault(question.category, Score()).extend(score)
        if question.category != 5:
            conv_score.extend(score)


def evaluate(
    convs: list[Conversation],
    systems: list[str],
    trials: Sequence[Recipe] = (),
    layers_wanted: Sequence[str] = ("facts", "messages", "sessions", "recall"),
) -> tuple[list[Run], dict[str, float]]:
    runs: dict[tuple[str, str], Run] = {}
    ceiling: list[float] = []

    def run_of(layer: str, system: str) -> Run:
        return runs.setdefault((layer, system), Run(layer, system))

    for conv in convs:
        cited = {dia for _, dia, _ in conv.facts}
        ceiling += [float(bool(q.evidence & cited)) for q in conv.questions if q.category != 5]
        # facts: one document per distinct fact text, standing for every turn it cites
        fact_units: dict[str, set[str]] = {}
        fact_rows: list[FactRow] = []
        for text, dia, when in conv.facts:
            key = normalize_text(text)
            if key not in fact_units:
                fact_units[key] = set()
                fact_rows.append((text, when, dia))
            fact_units[key].add(dia)
        fact_texts = [text for text, _, _ in fact_rows]
        fact_sets = [fact_units[normalize_text(t)] for t in fact_texts]
        messages = [f"{t.speaker}: {t.text}" for t in conv.turns]
        message_sets = [{t.dia_id} for t in conv.turns]
        summary_texts = [text for _, text, _ in conv.summaries]
        summary_sets = [{str(s)} for s, _, _ in conv.summaries]
        recall_sets = fact_sets + message_sets

        def facts_evidence(q: Question) -> frozenset[str]:
            return q.evidence

        def session_evidence(q: Question) -> frozenset[str]:
            return frozenset(str(session_of(d)) for d in q.evidence)

        with tempfile.TemporaryDirectory() as tmp:
            layers: list[tuple[str, dict[str, Callable[[], Retriever]], list[set[str]], Any]] = [
                (
                    "facts",
                    {
                        "ours": partial(OursFacts, Path(tmp) / "f", fact_rows, conv.turns),
                        "rank_bm25": partial(RankBM25, fact_texts),
                        "dense": partial(Dense, fact_texts),
                    },
                    fact_sets,
                    facts_evidence,
                ),
                (
                    "messages",
                    {
                        "ours": partial(OursMessages, conv.turns),
                        "ours+dense": partial(OursHybrid, conv.turns),
                        "rank_bm25": partial(RankBM25, messages),
                        "dense": partial(Dense, messages),
                    },
                    message_sets,
                    facts_evidence,
                ),
                (
                    "sessions",
                    {
                        "ours": partial(
                            OursHistory, Path(tmp) / "h", [(t, w) for _, t, w in conv.summaries]
                        ),
                        "ours-msgs": partial(
                            OursSessionsByMessages, conv.turns, [s for s, _, _ in conv.summaries]
                        ),
                        "rank_bm25": partial(RankBM25, summary_texts),
                        "dense": partial(Dense, summary_texts),
                    },
                    summary_sets,
                    session_evidence,
                ),
                (
                    "recall",
                    {"ours": partial(OursRecall, Path(tmp) / "r", conv, fact_rows)},
                    recall_sets,
                    facts_evidence,
                ),
            ]
            for recipe in trials:
                layers[0][1][recipe.name] = partial(
                    OursFacts, Path(tmp) / f"f-{recipe.name}", fact_rows, conv.turns, (), recipe
                )
                layers[3][1][recipe.name] = partial(
                    OursRecall, Path(tmp) / f"r-{recipe.name}", conv, fact_rows, recipe
                )
                layers[1][1][recipe.name] = partial(
                    OursRecipeMessages,
                    Path(tmp) / f"m-{recipe.name}",
                    fact_rows,
                    conv.turns,
                    (),
                    recipe,
                )
            for layer, makers, sets, evidence_of in layers:
                if layer not in layers_wanted:
                    continue
                for system, make in makers.items():
                    if re.split(r"[-+]", system)[0] not in systems:
                        continue
                    retriever = make()
                    judge(
                        run_of(layer, system),
                        conv,
                        retriever,
                        lambda i, sets=sets: sets[i],
                        evidence_of,
                    )
                    manager = getattr(retriever, "manager", None)
                    if manager is not None:
                        manager.close()
    extra = {"facts_ceiling_hit": round(100 * statistics.fmean(ceiling), 1) if ceiling else 0.0}
    return list(runs.values()), extra


def results(runs: list[Run]) -> list[Result]:
    out: list[Result] = []
    for run in runs:
        overall = Score()
        for category, score in run.by_category.items():
            if category != 5:
                overall.extend(score)
        lat = sorted(run.latencies)
        p50 = 1e6 * lat[len(lat) // 2] if lat else None
        p99 = 1e6 * lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None
        mem = statistics.fmean(run.memory) / 1024 if run.memory else None
        groups: list[tuple[str, Score]] = [("all 1-4", overall)]
        groups += [(CATEGORY_NAMES[c], run.by_category[c]) for c in sorted(run.by_category)]
        groups += [(f"conv {name}", score) for name, score in run.by_conv.items()]
        for group, score in groups:
            s = score.summary()
            first = group == "all 1-4"
            out.append(
                Result(
                    run.layer,
                    run.system,
                    group,
                    int(s["n"]),
                    s["hit@8"],
                    s["R@5"],
                    s["R@10"],
                    s["all@5"],
                    s["all@10"],
                    round(p50, 1) if first and p50 is not None else None,
                    round(p99, 1) if first and p99 is not None else None,
                    round(mem, 1) if first and mem is not None else None,
                )
            )
    return out


def print_table(rows: list[Result], extra: dict[str, float]) -> None:
    head = (
        f"{'layer':9} {'system':10} {'group':13} {'n':>4} {'hit@8':>6} {'R@5':>6} {'R@10':>6}"
        f" {'all@5':>6} {'all@10':>6} {'p50 us':>8} {'p99 us':>8} {'mem KB':>8}"
    )
    print(head)
    print("-" * len(head))
    last = ""
    for r in rows:
        if last and r.layer != last:
            print()
        last = r.layer

        def opt(value: float | None) -> str:
            return f"{value:8.1f}" if value is not None else f"{'':8}"

        print(
            f"{r.layer:9} {r.system:10} {r.group:13} {r.n:4d} {r.hit8:6.1f} {r.r5:6.1f}"
            f" {r.r10:6.1f} {r.all5:6.1f} {r.all10:6.1f} {opt(r.p50_us)} {opt(r.p99_us)}"
            f" {opt(r.memory_kb)}"
        )
    print()
    for key, value in extra.items():
        print(f"{key}: {value}")


@dataclass(slots=True)
class ScaleRow:
    engine: str
    messages: int
    build_s: float
    memory_mb: float
    p50_us: float
    p99_us: float


def scale_rows(convs: list[Conversation], size: int, queries: int = 200) -> list[ScaleRow]:
    """Latency at `size` messages (the LoCoMo turns repeated as further sessions): the
    message index's BM25, both fused, and the dense part of a fused search alone (coding
    the query and comparing it with BM25's candidates)."""
    turns = [t for conv in convs for t in conv.turns]
    questions = [q.text for conv in convs for q in conv.questions][:queries]
    batches: list[tuple[str, list[StoredMessage]]] = []
    count = 0
    copy = 0
    while count < size:
        for conv in convs:
            for sid, messages in stored_messages(conv.turns).items():
                take = messages[: size - count]
                batches.append((f"{copy}-{conv.name}-{sid}", take))
                count += len(take)
                if count >= size:
                    break
            if count >= size:
                break
        copy += 1
    del turns
    # The facts drawn from each turn, by its entry id in its conversation (the copies of
    # a conversation share them; for timing, the first conversation's are enough).
    facts_of: dict[str, list[str]] = {}
    first = convs[0]
    entry_of = {t.dia_id: str(i) for i, t in enumerate(first.turns)}
    for text, dia, _ in first.facts:
        if dia in entry_of:
            facts_of.setdefault(entry_of[dia], []).append(text)

    def fact_keys(entry_ids: Sequence[str]) -> dict[str, list[str]]:
        return {e: facts_of[e] for e in entry_ids if e in facts_of}

    now = max(t.when for conv in convs for t in conv.turns) + timedelta(days=1)
    rows: list[ScaleRow] = []
    engines: list[tuple[str, Callable[[], MessageIndex]]] = [("bm25", MessageIndex)]
    if sentence_embedder() is not None:
        engines.append(
            (
                "facts+minilm+time",
                lambda: MessageIndex(
                    dense=DenseIndex(bench_embedder(), bits=384, floor=SENTENCE_FLOOR),
                    fact_keys=fact_keys,
                ),
            )
        )
        for question in questions:
            query_vector(question)
    for name, make in engines:
        start = time.perf_counter()
        index = make()
        for handle, messages in batches:
            index.add(handle, messages)
        index.search("warm up", 1)
        build = time.perf_counter() - start
        lat: list[float] = []
        dense_on = index._dense is not None
        for question in questions:
            vector = query_vector(question) if dense_on else None
            during = recall_time(question, now) if dense_on else None
            t0 = time.process_time()
            index.search(question, RECALL_LIMIT, context=False, query_vector=vector, during=during)
            lat.append(time.process_time() - t0)
        lat.sort()
        rows.append(
            ScaleRow(
                name,
                count,
                round(build, 1),
                round(index.memory_bytes() / 2**20, 1),
                round(1e6 * lat[len(lat) // 2], 1),
                round(1e6 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 1),
            )
        )
        dense = index._dense  # what fusing adds to a search: code the query, compare 50
        if dense is not None:
            candidates = [h.doc_id for h in index._index.search("warm up", FUSION_DEPTH)]
            lat = []
            for question in questions:
                vector = query_vector(question)
                t0 = time.process_time()
                dense.similarities(dense.code_of(vector), candidates)
                lat.append(time.process_time() - t0)
            lat.sort()
            rows.append(
                ScaleRow(
                    "dense part",
                    count,
                    0.0,
                    round(dense.memory_bytes() / 2**20, 1),
                    round(1e6 * lat[len(lat) // 2], 1),
                    round(1e6 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 1),
                )
            )
    return rows


def postgres_rows(conv: Conversation, url: str) -> list[ScaleRow]:
    """The message search of the PostgreSQL mode on one conversation: its sessions
    written through the session API (one key, each session archived by a reset), then
    searched through `PostgresMemoryStore` (a round trip per search to see what is new)."""
    from bench.memory_pg import scratch_pool
    from gateway.llm import LLMMessage
    from gateway.memory.pg_store import PostgresMemoryStore
    from gateway.sessions import SessionManager
    from gateway.sessions.pg_store import PostgresSessions

    key = f"locomo:{conv.name}"
    rows: list[ScaleRow] = []
    with scratch_pool(url) as pool:
        sessions = SessionManager.shared(PostgresSessions(pool))
        start = time.perf_counter()
        current = -1
        for turn in conv.turns:
            if turn.session != current:
                if current >= 0:
                    sessions.reset(key)
                current = turn.session
            role = "user" if turn.speaker == conv.turns[0].speaker else "assistant"
            sessions.get_or_create(key).add_message(LLMMessage(role, message_of(turn)))
        written = time.perf_counter() - start
        store = PostgresMemoryStore(pool)
        memory = store.for_session(key)
        start = time.perf_counter()
        memory.search_messages("warm up", 1)
        first = time.perf_counter() - start
        lat: list[float] = []
        for question in conv.questions:
            t0 = time.perf_counter()
            memory.search_messages(question.text, RECALL_LIMIT, context=False)
            lat.append(time.perf_counter() - t0)
        lat.sort()
        index = memory.messages
        size = index.memory_bytes() / 2**20 if index is not None else 0.0
        rows.append(
            ScaleRow(
                "postgres",
                len(conv.turns),
                round(first, 2),
                round(size, 1),
                round(1e6 * lat[len(lat) // 2], 1),
                round(1e6 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 1),
            )
        )
        sessions.close()
        print(f"(postgres: {len(conv.turns)} messages written in {written:.1f} s)", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--quick", action="store_true", help="two conversations only")
    parser.add_argument(
        "--scale",
        type=int,
        default=100_000,
        help="also time the message index at this many messages (0: skip; --quick skips)",
    )
    parser.add_argument(
        "--pg",
        metavar="URL",
        help="also time message search in the PostgreSQL mode (a scratch schema on URL)",
    )
    parser.add_argument(
        "--systems",
        default="ours,rank_bm25,dense",
        help="comma-separated subset of ours,rank_bm25,dense",
    )
    parser.add_argument(
        "--trials",
        default="",
        help=f"issue 41's recall trials on facts and messages: 'all' or some of {','.join(TRIALS)}",
    )
    parser.add_argument(
        "--layers",
        default="facts,messages,sessions,recall",
        help="comma-separated subset of facts,messages,sessions,recall",
    )
    args = parser.parse_args(argv)
    logger.remove()  # the indexes' debug lines would bury the table
    files = sorted(args.data.glob("*.json"))
    if not files:
        parser.error(f"no LoCoMo conversations (*.json) in {args.data}")
    if args.quick:
        files = files[:2]
    convs = [load_conversation(path) for path in files]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    names = list(TRIALS) if args.trials == "all" else [t for t in args.trials.split(",") if t]
    unknown = [name for name in names if name not in TRIALS]
    if unknown:
        parser.error(f"unknown trials {unknown}; choose from {list(TRIALS)}")
    trials = [TRIALS[name] for name in names]
    if any(recipe.dense for recipe in trials):
        for conv in convs:  # the turn's vector, computed before anything is timed
            for question in conv.questions:
                query_vector(question.text)
    layers = [layer.strip() for layer in args.layers.split(",") if layer.strip()]
    runs, extra = evaluate(convs, systems, trials, layers)
    rows = results(runs)
    scale = [] if args.quick or args.scale <= 0 else scale_rows(convs, args.scale)
    if args.pg:
        scale += postgres_rows(convs[0], args.pg)
    if args.json:
        print(
            json.dumps(
                {"rows": [asdict(r) for r in rows], "scale": [asdict(r) for r in scale], **extra},
                indent=1,
            )
        )
        return 0
    print_table(rows, extra)
    if scale:
        print()
        head = f"{'engine':12} {'messages':>9} {'build s':>8} {'mem MB':>7} {'p50 us':>8}"
        print(f"{head} {'p99 us':>8}")
        for r in scale:
            print(
                f"{r.engine:12} {r.messages:9d} {r.build_s:8.1f} {r.memory_mb:7.1f}"
                f" {r.p50_us:8.1f} {r.p99_us:8.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
