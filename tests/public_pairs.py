"""Public question pairs for judging the near-duplicate cache layer, split into a tuning
part and a held-out part that is never tuned on.

The pairs are the `fow-cache` package's question benchmark (PyPI, version pinned in the
dev extra; the data is CC BY 4.0, (c) 2026 Mabon ap Gwyn, github.com/Maby0/fow-cache):
600 pairs of support-desk questions written for judging semantic caches, each labelled
`same_answer`. 300 should share an answer (near repeats with typos and fillers, light
and heavy rewordings); 300 are hard negatives on the same topic that differ in one
thing (negation, an entity, a number or date, the scope). Nothing in this project was
written from them; they are installed from PyPI and read from the package, never
downloaded at run time.

The split is fixed: pairs are grouped by (category, label), each group is sorted by id
and shuffled with `random.Random(SPLIT_SEED)`, and the first half of every group is the
tuning part, the rest the held-out part (300 pairs each, same mix). The guard rules and
the shipped threshold were chosen on the tuning part only; the held-out part is only
ever scored.
"""

from __future__ import annotations

import importlib.util
import random
from typing import Literal

SPLIT_SEED = 15
DATASET = "fow-cache 0.1.0 questions (CC BY 4.0)"

Pair = tuple[str, str, bool]


def public_pairs_available() -> bool:
    """True when the `fow-cache` package (a dev dependency) is installed."""
    return importlib.util.find_spec("fow_cache") is not None


def public_pairs(part: Literal["tune", "held-out", "all"]) -> list[Pair]:
    """`(cached question, new question, same answer)` for one part of the fixed split."""
    from fow_cache.data import load_questions

    groups: dict[tuple[str, bool], list[dict[str, object]]] = {}
    for row in load_questions():
        groups.setdefault((str(row["category"]), bool(row["same_answer"])), []).append(row)
    rng = random.Random(SPLIT_SEED)
    tune: list[Pair] = []
    held_out: list[Pair] = []
    for key in sorted(groups):
        rows = sorted(groups[key], key=lambda r: str(r["id"]))
        rng.shuffle(rows)
        half = len(rows) // 2
        for i, row in enumerate(rows):
            pair = (str(row["a"]), str(row["b"]), bool(row["same_answer"]))
            (tune if i < half else held_out).append(pair)
    return {"tune": tune, "held-out": held_out, "all": tune + held_out}[part]
