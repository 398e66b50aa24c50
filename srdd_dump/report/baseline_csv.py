"""GPU-baseline report as CSV: the compare table at the given path, the file table at
``<stem>.files.csv`` and, when the dumps hold sub-layers or operators, their rows at
``<stem>.sublayers.csv``. Every text cell is escaped against formula injection."""

from __future__ import annotations

from ..compare.results import BaselineResult
from .diagnosis_csv import files_csv_path, sibling_path
from .escape import escape_formulas


def write_csv(result: BaselineResult, path: str) -> list[str]:
    """The compare table at ``path`` and the other tables next to it; returns their paths."""
    written = [path, files_csv_path(path)]
    escape_formulas(result.table).to_csv(path, index=False)
    escape_formulas(result.files).to_csv(written[1], index=False)
    if len(result.sites):
        written.append(sibling_path(path, "sublayers"))
        escape_formulas(result.sites).to_csv(written[-1], index=False)
    return written
