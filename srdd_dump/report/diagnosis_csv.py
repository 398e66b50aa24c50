"""Reference-free report as CSV: the layer table at the given path; ``<stem>.files.csv`` lists
the input files and ``<stem>.sublayers.csv`` the sub-layer signals (when the dump has them)."""

from __future__ import annotations

import os

from ..compare.results import CompareResult
from .escape import escape_formulas


def sibling_path(csv_path: str, part: str) -> str:
    """``report.csv`` -> ``report.<part>.csv``, next to it."""
    stem, _ = os.path.splitext(csv_path)
    return f"{stem}.{part}.csv"


def files_csv_path(csv_path: str) -> str:
    return sibling_path(csv_path, "files")


def write_csv(result: CompareResult, path: str) -> list[str]:
    """Write the tables of a CompareResult; returns the paths written (layers first)."""
    written = [path, files_csv_path(path)]
    # Escaped too: CSV files are opened in spreadsheet programs as often as XLSX.
    escape_formulas(result.layers).to_csv(path, index=False)
    escape_formulas(result.files).to_csv(written[1], index=False)
    sublayers = sibling_path(path, "sublayers")
    if len(result.sites):
        written.append(sublayers)
        escape_formulas(result.sites).to_csv(sublayers, index=False)
    elif os.path.isfile(sublayers):  # an earlier report's, beside this one: not of this run
        os.remove(sublayers)
    return written
