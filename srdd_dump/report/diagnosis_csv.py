"""Reference-free report as CSV: the layer table at the given path; ``<stem>.files.csv`` lists
the input files and ``<stem>.sublayers.csv`` the sub-layer signals (when the dump has them)."""

from __future__ import annotations

import csv
import os

from ..compare.results import CompareResult
from ..compare.table import Table
from .escape import escape_formula, escape_formulas


def sibling_path(csv_path: str, part: str) -> str:
    """``report.csv`` -> ``report.<part>.csv``, next to it."""
    stem, _ = os.path.splitext(csv_path)
    return f"{stem}.{part}.csv"


def files_csv_path(csv_path: str) -> str:
    return sibling_path(csv_path, "files")


# the consistency check's CSV files beside a report (report/consistency.py writes them)
CONSISTENCY_PARTS = ("consistency", "consistency_summary")


def write_csv(result: CompareResult, path: str) -> list[str]:
    """Write the tables of a CompareResult; returns the paths written (layers first)."""
    written = [path, files_csv_path(path)]
    write_table(result.layer_table, path)
    write_table(result.file_table, written[1])
    if len(result.site_table):
        written.append(sibling_path(path, "sublayers"))
        write_table(result.site_table, written[-1])
    return written


def write_table(table: Table, path: str) -> None:
    """``table`` as CSV, text cells escaped (CSV files are opened in spreadsheet programs as
    often as XLSX): the bytes ``DataFrame.to_csv`` writes, without pandas where the table's
    own rows say them (``Table.text_rows``)."""
    texts = table.text_rows(escape_formula)
    if texts is None:
        escape_formulas(table.frame()).to_csv(path, index=False)
        return
    with open(path, "w", newline="", encoding="utf-8") as fh:
        out = csv.writer(fh, lineterminator=os.linesep)  # pandas' default
        out.writerow(table.columns)
        out.writerows(texts)
