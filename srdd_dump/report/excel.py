"""XLSX output: sheet 'layers' (coloured by verdict, frozen header) and sheet 'files'."""

from __future__ import annotations

import pandas as pd
from openpyxl.styles import Font, PatternFill
from openpyxl.utils import get_column_letter

from ..analysis.basic import FAULT, SUSPECT
from .table import escape_formulas

LAYERS_SHEET = "layers"
FILES_SHEET = "files"
FILLS = {
    FAULT: PatternFill(fill_type="solid", start_color="FFFFC7CE", end_color="FFFFC7CE"),  # red
    SUSPECT: PatternFill(fill_type="solid", start_color="FFFFEB9C", end_color="FFFFEB9C"),
}
MAX_WIDTH = 60


def write_xlsx(layers: pd.DataFrame, files: pd.DataFrame, path: str) -> list[str]:
    """Write both tables to one workbook; returns ``[path]``."""
    with pd.ExcelWriter(path, engine="openpyxl") as xw:
        escape_formulas(layers).to_excel(xw, sheet_name=LAYERS_SHEET, index=False)
        escape_formulas(files).to_excel(xw, sheet_name=FILES_SHEET, index=False)
        ws = xw.sheets[LAYERS_SHEET]
        verdict_col = list(layers.columns).index("verdict")
        for i, verdict in enumerate(layers["verdict"], start=2):  # row 1 is the header
            fill = FILLS.get(verdict)
            if fill is not None:
                for cell in ws[i]:
                    cell.fill = fill
                ws.cell(row=i, column=verdict_col + 1).font = Font(bold=True)
        for name, df in ((LAYERS_SHEET, layers), (FILES_SHEET, files)):
            sheet = xw.sheets[name]
            sheet.freeze_panes = "A2"
            if len(df.columns):
                sheet.auto_filter.ref = sheet.dimensions
            _fit_columns(sheet, df)
    return [path]


def _fit_columns(sheet, df: pd.DataFrame) -> None:
    for j, col in enumerate(df.columns, start=1):
        longest = df[col].astype(str).str.len().max() if len(df) else 0
        width = min(MAX_WIDTH, max(len(str(col)), int(longest or 0)) + 2)
        sheet.column_dimensions[get_column_letter(j)].width = width
