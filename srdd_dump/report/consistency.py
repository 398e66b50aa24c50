"""Report of a multi-card consistency check: CSV, XLSX sheets, terminal lines.

* ``report.csv`` -> ``report.consistency.csv`` (per layer and source) and
  ``report.consistency_summary.csv`` (per source), next to it.
* ``report.xlsx`` -> sheets ``consistency`` (departing rows red, first departures bold) and
  ``consistency_summary``, added to the workbook when it exists (other sheets are kept).
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
from openpyxl.styles import Font, PatternFill

from ..compare.results import ConsistencyResult
from .diagnosis_csv import CONSISTENCY_PARTS, sibling_path
from .escape import escape_formulas
from .sheets import format_table

TABLE_SHEET = "consistency"
SUMMARY_SHEET = "consistency_summary"
RED = PatternFill(fill_type="solid", start_color="FFFFC7CE", end_color="FFFFC7CE")


def consistency_paths(report_path: str) -> list[str]:
    """Files ``write_consistency`` writes for a report path (CSV: two siblings; XLSX: itself)."""
    if os.path.splitext(report_path)[1].lower() == ".csv":
        return [sibling_path(report_path, part) for part in CONSISTENCY_PARTS]
    return [report_path]


def write_consistency(result: ConsistencyResult, report_path: str) -> list[str]:
    """Write the consistency tables for a report at ``report_path`` (.csv or .xlsx)."""
    ext = os.path.splitext(report_path)[1].lower()
    paths = consistency_paths(report_path)
    if ext == ".csv":
        escape_formulas(result.table).to_csv(paths[0], index=False)
        escape_formulas(result.summary).to_csv(paths[1], index=False)
        return paths
    exists = os.path.exists(report_path)
    kwargs = {"mode": "a", "if_sheet_exists": "replace"} if exists else {"mode": "w"}
    with pd.ExcelWriter(Path(report_path), engine="openpyxl", **kwargs) as xw:  # any case
        escape_formulas(result.table).to_excel(xw, sheet_name=TABLE_SHEET, index=False)
        escape_formulas(result.summary).to_excel(xw, sheet_name=SUMMARY_SHEET, index=False)
        ws = xw.sheets[TABLE_SHEET]
        first_col = result.table.columns.get_loc("first_departure") + 1
        for i, (departs, first) in enumerate(
            zip(result.table["departs"], result.table["first_departure"]), start=2
        ):
            if departs:
                for cell in ws[i]:
                    cell.fill = RED
            if first:
                ws.cell(row=i, column=first_col).font = Font(bold=True)
        for name, df in ((TABLE_SHEET, result.table), (SUMMARY_SHEET, result.summary)):
            sheet = xw.sheets[name]
            format_table(sheet, df)
    return paths
