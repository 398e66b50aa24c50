"""The layout of every XLSX data sheet the reports write (openpyxl: imported for XLSX only)."""

from __future__ import annotations

import pandas as pd
from openpyxl.utils import get_column_letter

MAX_WIDTH = 60  # characters; longer cells wrap or are cut in the view, never in the data
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
