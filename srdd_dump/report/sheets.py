"""What every report table goes through: formula escaping (CSV and XLSX) and XLSX sheet layout."""

from __future__ import annotations

import pandas as pd
from openpyxl.utils import get_column_letter

MAX_WIDTH = 60  # characters; longer cells wrap or are cut in the view, never in the data
# Spreadsheet programs run a cell that starts with one of these as a formula.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def escape_formula(value):
    """Prefix a quote to a text that a spreadsheet would run as a formula; others unchanged."""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def escape_formulas(df: pd.DataFrame) -> pd.DataFrame:
    """Copy of ``df`` with every text cell passed through ``escape_formula``."""
    out = df.copy()
    for col in out.columns:
        if not pd.api.types.is_numeric_dtype(out[col]):
            out[col] = out[col].map(escape_formula)
    return out


def fit_columns(sheet, df: pd.DataFrame) -> None:
    """Set each column's width to its longest cell (header included), at most MAX_WIDTH."""
    for j, col in enumerate(df.columns, start=1):
        longest = df[col].astype(str).str.len().max() if len(df) else 0
        longest = 0 if pd.isna(longest) else int(longest)  # an all-missing column
        width = min(MAX_WIDTH, max(len(str(col)), longest) + 2)
        sheet.column_dimensions[get_column_letter(j)].width = width


def format_table(sheet, df: pd.DataFrame) -> None:
    """A data sheet written from ``df``: header row frozen, filters on, columns fitted."""
    sheet.freeze_panes = "A2"
    if len(df.columns):
        sheet.auto_filter.ref = sheet.dimensions
    fit_columns(sheet, df)
