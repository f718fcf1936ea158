"""GitHub-flavoured Markdown tables found in the model's text, for the formatters of
platforms that draw none (Slack, WhatsApp, Discord turn them into aligned code blocks).
Pure functions; what each platform makes of a table stays in its own formatter."""

from __future__ import annotations

import re

#: A table's delimiter row (`| --- | :-: |`): dashes, optional colons, pipes between.
TABLE_DELIMITER = re.compile(r"^ {0,3}\|?[ \t]*:?-+:?[ \t]*(\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*$")


def table_cells(row: str) -> list[str]:
    """A table row's cells: split at `|` (not `\\|`), the outer pipes dropped."""
    row = row.strip().removeprefix("|")
    if row.endswith("|") and not row.endswith("\\|"):
        row = row[:-1]
    return [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", row)]


def table_at(lines: list[str], start: int) -> int:
    """How many lines from `start` form a GFM table (a header row with pipes, a
    delimiter row with pipes and as many columns, then rows with pipes); 0 if none
    starts there."""
    if start + 1 >= len(lines) or "|" not in lines[start]:
        return 0
    delimiter = lines[start + 1]
    if "|" not in delimiter or not TABLE_DELIMITER.match(delimiter):
        return 0
    if len(table_cells(delimiter)) != len(table_cells(lines[start])):
        return 0
    end = start + 2
    while end < len(lines) and "|" in lines[end] and lines[end].strip():
        end += 1
    return end - start
