"""What every kind of state's part of `gateway storage import|export` shares: the outcome
of an item, the progress report (`Transfer`, a `Tally` per kind), `DamagedFile`, and the
reading and writing of the file mode's state files (see `gateway.storage.transfer` for
the promises every part keeps)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO, TypeVar

from gateway.fsutil import create_exclusive

if TYPE_CHECKING:
    import psycopg


_S = TypeVar("_S")
_K = TypeVar("_K")
_V = TypeVar("_V")

Outcome = Literal["moved", "present", "damaged", "conflict"]

_OUTCOMES: tuple[Outcome, ...] = ("moved", "present", "damaged", "conflict")


@dataclass(slots=True)
class Tally:
    """What happened to the items of one kind of state."""

    kind: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_OUTCOMES, 0))

    @property
    def clean(self) -> bool:
        return not (self.counts["damaged"] or self.counts["conflict"])

    def summary(self, verb: str) -> str:
        c = self.counts
        return (
            f"{self.kind}: {c['moved']} {verb}, {c['present']} already there, "
            f"{c['damaged']} damaged (skipped), {c['conflict']} conflicting (left as they are)"
        )


class Transfer:
    """Progress of one import or export: a line on ``out`` per item, tallies per kind."""

    def __init__(self, verb: str, out: TextIO | None = None) -> None:
        self.verb = verb
        self.out = out if out is not None else sys.stderr
        self.tallies: dict[str, Tally] = {}

    def note(
        self, kind: str, outcome: Outcome, item: str, detail: str, position: tuple[int, int]
    ) -> None:
        tally = self.tallies.setdefault(kind, Tally(kind))
        tally.counts[outcome] += 1
        word = {
            "moved": self.verb,
            "present": "skipped",
            "damaged": "DAMAGED",
            "conflict": "CONFLICT",
        }
        done, total = position
        line = f"{kind} [{done}/{total}] {word[outcome]} {item}: {detail}"
        print(line, file=self.out, flush=True)

    def exported_before(
        self, kind: str, item: str, same: bool, what: str, position: tuple[int, int]
    ) -> None:
        """An export found ``what`` (a file, a folder) under the item's name already:
        the item is there when it is the ``same``, a conflict (left alone) when not."""
        if same:
            self.note(kind, "present", item, "already exported", position)
        else:
            detail = f"a different {what} is there; it was not overwritten"
            self.note(kind, "conflict", item, detail, position)

    def start(self, kind: str, found: int, where: Path) -> None:
        self.tallies.setdefault(kind, Tally(kind))
        print(f"{kind}: {found} found in {where}", file=self.out, flush=True)

    @property
    def clean(self) -> bool:
        return all(t.clean for t in self.tallies.values())

    def summary(self) -> str:
        return "; ".join(t.summary(self.verb) for t in self.tallies.values())


#: An import or export of one kind of state: (connection, workspace folder, progress).
Step = Callable[["psycopg.Connection[Any]", Path, Transfer], None]


class DamagedFile(Exception):
    """A session file that cannot be imported as it is; the message says why."""


def epoch(ns: int) -> float:
    """Nanoseconds as the float the export wrote (`nanoseconds` inverts it exactly)."""
    return float(Fraction(ns, 1_000_000_000))


def nanoseconds(at: float) -> int:
    return round(Fraction(at) * 1_000_000_000)


def read_state_file(path: Path, parse: Callable[[str], _S]) -> _S | None:
    """A whole-workspace state file parsed by ``parse`` (None when there is none);
    `DamagedFile` when it cannot be read as it is."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return parse(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise DamagedFile(f"{path.name} cannot be read ({exc})") from None


def damaged_state_file(transfer: Transfer, kind: str, path: Path, exc: DamagedFile) -> None:
    """A state file that cannot be read: reported as one damaged item, kept as it is."""
    transfer.start(kind, 1, path)
    transfer.note(kind, "damaged", path.name, f"{exc}; the file stays as it is", (1, 1))


def rows_to_import(
    transfer: Transfer, kind: str, path: Path, read: Callable[[], Mapping[_K, _V] | None]
) -> Mapping[_K, _V] | None:
    """An import's rows from its state file (`read`: none when there is no file), with
    the count started; None when the file is damaged (reported as one item and kept)."""
    try:
        rows = read() or {}
    except DamagedFile as exc:
        damaged_state_file(transfer, kind, path, exc)
        return None
    transfer.start(kind, len(rows), path)
    return rows


def write_state_file(
    kind: str,
    path: Path,
    rows: dict[Any, Any],
    existing: dict[Any, Any] | None,
    data: bytes,
    describe: Callable[[Any, Any], tuple[str, str]],
    transfer: Transfer,
) -> None:
    """Export a whole-workspace state file: written when there is none; otherwise each
    item is reported against the file that is there, which is never changed (a
    different or missing item is a conflict: files are not merged)."""
    if existing is None:
        try:
            create_exclusive(path, data)
        except FileExistsError:
            existing = {}
        else:
            for n, (which, row) in enumerate(rows.items(), start=1):
                item, detail = describe(which, row)
                transfer.note(kind, "moved", item, detail, (n, len(rows)))
            return
    for n, (which, row) in enumerate(rows.items(), start=1):
        item, detail = describe(which, row)
        if existing.get(which) == row:
            transfer.note(kind, "present", item, "already exported", (n, len(rows)))
        else:
            transfer.note(
                kind,
                "conflict",
                item,
                f"{path.name} is there without it; the file was not changed",
                (n, len(rows)),
            )
