"""GPU-baseline report as CSV: the compare table at the given path and the file table at
``<stem>.files.csv``. Every text cell is escaped against formula injection."""

from __future__ import annotations

from ..compare.results import BaselineResult
from .diagnosis_csv import files_csv_path
from .escape import escape_formulas


def write_csv(result: BaselineResult, path: str) -> list[str]:
    """The compare table at ``path`` and the file table next to it; returns both paths."""
    files_path = files_csv_path(path)
    escape_formulas(result.table).to_csv(path, index=False)
    escape_formulas(result.files).to_csv(files_path, index=False)
    return [path, files_path]
