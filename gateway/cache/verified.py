"""When a near-duplicate may be served: thresholds per entry, kept under an error bound.

The operator sets `max_error`, the fraction of served near-duplicate hits allowed to be
wrong (default 1%). The idea is vCache's ("vCache: Verified Semantic Prompt Caching",
2025): a fixed similarity threshold is wrong for some entries and wasteful for others,
so every entry keeps labelled observations, `(similarity, the stored answer was
right)`, and its own threshold follows them. A label costs no extra model call: a
candidate that is not served is a miss, the model answers anyway, and its answer is
compared with the candidate's (`SemanticCache.store`).

What differs from vCache, and why:

- vCache bounds the wrong answers among *all* lookups and reaches that by serving an
  uncertain candidate at random; the bound here is on *served* hits (precision), so a
  candidate is served only when the evidence says it may be, never by chance.
- One entry rarely gathers the hundreds of labels a 1% bound needs, so the bound is
  certified on the labels of the whole partition (`shared_threshold`: the lowest
  similarity above which the labelled candidates, counting one more wrong one than
  seen, are within the bound), and every entry then tightens on its own wrong labels
  (`entry_threshold`: above the highest similarity at which its answer was wrong).
- Until the labels certify a threshold, the model's prior one (chosen on the tuning
  data, `MINILM_NEAR_DUPLICATE_THRESHOLD`) holds, raised above every wrong label.
- A served hit yields no label, so a small share of servable candidates is audited
  (`audit_rate`, every 20th by default: answered by the model and labelled); that is
  how a threshold that is too low gets caught once serving has begun.

The guard (`guard_conflict`) vetoes a candidate before any of this.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

#: How far above a wrong label an entry's threshold goes.
MARGIN = 0.0025
#: Labels kept per entry (the newest); enough to place its threshold.
MAX_OBSERVATIONS = 64
#: Share of servable candidates answered by the model to keep labelling.
DEFAULT_AUDIT_RATE = 0.05
#: The default bound: 1% of served near-duplicate hits may be wrong.
DEFAULT_MAX_ERROR = 0.01
#: One-sided 95%: the wrong rate of the labels above a certified threshold is within
#: the bound with that confidence (Wilson's interval).
CONFIDENCE_Z = 1.645
#: A threshold above every similarity: nothing is served.
NEVER = math.inf


@dataclass(frozen=True, slots=True)
class Observation:
    """A candidate's label: its similarity to the question and whether its stored
    answer was the right one for it."""

    similarity: float
    correct: bool


class Verdict(StrEnum):
    SERVE = "serve"
    #: Below the entry's threshold: the model answers, and the answers are compared.
    EXPLORE = "explore"
    #: Servable, but answered by the model for a label (`audit_rate`).
    AUDIT = "audit"


def shared_threshold(
    observations: Iterable[Observation], *, max_error: float, prior: float
) -> float:
    """The similarity above which a partition's candidates may be served.

    The lowest `t` at which the labels at or above `t` satisfy
    `(wrong + 1) / (labelled + 1) <= max_error` (at 1% that takes at least 99 labels
    and no wrong one, 199 with one wrong, ...). Without such a `t`: `prior`, raised
    above the highest wrong label."""
    labels = sorted(observations, key=lambda o: -o.similarity)
    best: float | None = None
    wrong = 0
    highest_wrong = -math.inf
    for i, obs in enumerate(labels):
        labelled = i + 1
        if not obs.correct:
            wrong += 1
            highest_wrong = max(highest_wrong, obs.similarity)
        last_at_this_similarity = i + 1 == len(labels) or labels[i + 1].similarity < obs.similarity
        if last_at_this_similarity and wrong_rate_bound(wrong, labelled) <= max_error:
            best = obs.similarity
    if best is not None:
        return best
    # The prior stands while no label contradicts it; once one does, only labels can
    # certify a threshold again.
    return prior if highest_wrong < prior else NEVER


def wrong_rate_bound(wrong: int, labelled: int, *, z: float = CONFIDENCE_Z) -> float:
    """Wilson's upper confidence bound on a wrong rate seen as `wrong` of `labelled`."""
    if labelled == 0:
        return 1.0
    p = wrong / labelled
    z2 = z * z
    centre = p + z2 / (2 * labelled)
    spread = z * math.sqrt(p * (1 - p) / labelled + z2 / (4 * labelled * labelled))
    return (centre + spread) / (1 + z2 / labelled)


def entry_threshold(shared: float, observations: Iterable[Observation]) -> float:
    """`shared`, raised above every similarity at which this entry's answer was wrong."""
    wrong = [o.similarity for o in observations if not o.correct]
    return max(shared, max(wrong) + MARGIN) if wrong else shared


def audit_every(audit_rate: float) -> int:
    """Audit every n-th servable candidate (0: never): counted, not drawn, so replicas
    and tests behave the same every time."""
    return round(1 / audit_rate) if audit_rate > 0 else 0


def verdict(
    similarity: float, threshold: float, *, servable_seen: int, audit_rate: float
) -> Verdict:
    """Serve a candidate at or above its entry's `threshold`, except every
    `audit_every(audit_rate)`-th one (`servable_seen` counts them, this one included);
    explore one below it."""
    if similarity < threshold:
        return Verdict.EXPLORE
    every = audit_every(audit_rate)
    return Verdict.AUDIT if every and servable_seen % every == 0 else Verdict.SERVE
