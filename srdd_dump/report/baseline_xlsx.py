"""GPU-baseline report as XLSX: sheets ``compare`` (msprobe-style row colours), ``summary``
(first divergent layer, worst layers, per-layer table and a line chart of cosine similarity and
relative error against the layer), ``files`` and, when the dumps hold sub-layers or operators,
``sublayers``. Every text cell is escaped against formula
injection.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from openpyxl.chart import LineChart, Reference
from openpyxl.styles import Font, PatternFill

from ..analysis.verdicts import VERDICTS
from ..compare.divergence import RED, YELLOW
from ..compare.results import BaselineResult
from .escape import escape_formula, escape_formulas
from .sheets import format_table

COMPARE_SHEET = "compare"
SUMMARY_SHEET = "summary"
FILES_SHEET = "files"
SITES_SHEET = "sublayers"
FILLS = {
    RED: PatternFill(fill_type="solid", start_color="FFFFC7CE", end_color="FFFFC7CE"),
    YELLOW: PatternFill(fill_type="solid", start_color="FFFFEB9C", end_color="FFFFEB9C"),
}


def write_xlsx(result: BaselineResult, path: str) -> list[str]:
    """Sheets compare, summary (with the chart) and files; returns ``[path]``."""
    table = result.table
    # a Path: pandas refuses a str path whose extension is not lower case (R.XLSX)
    with pd.ExcelWriter(Path(path), engine="openpyxl") as xw:
        _finite_cells(escape_formulas(table)).to_excel(xw, sheet_name=COMPARE_SHEET, index=False)
        xw.book.create_sheet(SUMMARY_SHEET)
        escape_formulas(result.files).to_excel(xw, sheet_name=FILES_SHEET, index=False)
        if len(result.sites):
            _finite_cells(escape_formulas(result.sites)).to_excel(
                xw, sheet_name=SITES_SHEET, index=False)
            format_table(xw.sheets[SITES_SHEET], result.sites)
        ws = xw.sheets[COMPARE_SHEET]
        bold = Font(bold=True)
        first_col = table.columns.get_loc("first_divergence") + 1
        for i, (mark, first) in enumerate(zip(table["highlight"], table["first_divergence"]), 2):
            fill = FILLS.get(mark)
            if fill is not None:
                for cell in ws[i]:
                    cell.fill = fill
            if first:
                ws.cell(row=i, column=first_col).font = bold
        for name, df in ((COMPARE_SHEET, table), (FILES_SHEET, result.files)):
            sheet = xw.sheets[name]
            format_table(sheet, df)
        _summary_sheet(xw.book[SUMMARY_SHEET], result)
    return [path]


def _finite_cells(df: pd.DataFrame) -> pd.DataFrame:
    """Excel has no Inf: write +-Inf as the text 'inf' / '-inf' (NaN stays an empty cell)."""
    out = df.copy()
    for col in out.columns:
        if pd.api.types.is_float_dtype(out[col]):
            values = out[col]
            if values.isin([math.inf, -math.inf]).any():
                out[col] = values.astype(object).where(~values.isin([math.inf]), "inf")
                out[col] = out[col].where(~values.isin([-math.inf]), "-inf")
    return out


def _summary_sheet(ws, result: BaselineResult) -> None:
    s = result.summary
    lines = [
        ("my dumps", result.path),
        ("golden dumps", result.baseline),
        ("compared rounds", s.rounds),
        *((f"{v} rows", s.verdicts[v]) for v in VERDICTS),
        ("first divergent layer", "" if s.first_layer is None else s.first_layer),
        ("first divergent module", s.first_module),
        ("rounds the error was born there", s.first_rounds if s.first_layer is not None else ""),
        ("finding", s.message),
    ]
    lines += [(f"not compared: {k}", v) for k, v in s.not_compared.items()]
    lines += [("unmatched", line) for line in s.unmatched]
    lines += [("note", note) for note in result.notes]  # e.g. a statistics-only side
    ws.cell(row=1, column=1, value="srdd-compare: GPU-baseline summary").font = Font(bold=True)
    for i, (key, value) in enumerate(lines, start=2):
        ws.cell(row=i, column=1, value=key)
        ws.cell(row=i, column=2, value=escape_formula(value))
    row = len(lines) + 3
    ws.cell(row=row, column=1, value="worst layers (largest relative error)").font = Font(bold=True)
    row = _write_frame(ws, s.worst, row + 1) + 2
    ws.cell(row=row, column=1, value="per layer, over every compared round").font = Font(bold=True)
    header = row + 1
    last = _write_frame(ws, s.per_layer, header)
    ws.column_dimensions["A"].width = 34
    ws.column_dimensions["B"].width = 40
    if len(s.per_layer):
        _chart(ws, s.per_layer, header, last)


def _write_frame(ws, df: pd.DataFrame, row: int) -> int:
    """Write a header and the rows of ``df`` from ``row``; returns the last row written."""
    df = _finite_cells(escape_formulas(df))
    for j, col in enumerate(df.columns, start=1):
        ws.cell(row=row, column=j, value=str(col)).font = Font(bold=True)
    for i, values in enumerate(df.itertuples(index=False), start=row + 1):
        for j, value in enumerate(values, start=1):
            ws.cell(row=i, column=j, value=None if _missing(value) else _plain(value))
    return row + len(df)


def _chart(ws, per_layer: pd.DataFrame, header: int, last: int) -> None:
    cols = list(per_layer.columns)
    layer = cols.index("layer") + 1
    cos = cols.index("min_cosine_similarity") + 1
    red = cols.index("max_relative_euclidean_distance") + 1
    chart = LineChart()
    chart.title = "cosine similarity and relative error by layer"
    chart.x_axis.title = "layer"
    chart.y_axis.title = "cosine similarity (min)"
    chart.add_data(Reference(ws, min_col=cos, min_row=header, max_row=last), titles_from_data=True)
    chart.set_categories(Reference(ws, min_col=layer, min_row=header + 1, max_row=last))
    errors = LineChart()
    errors.add_data(Reference(ws, min_col=red, min_row=header, max_row=last), titles_from_data=True)
    errors.y_axis.axId = 200
    errors.y_axis.title = "relative error (max)"
    errors.y_axis.crosses = "max"
    for axis in (chart.x_axis, chart.y_axis, errors.y_axis):
        axis.delete = False
    chart += errors
    chart.height, chart.width = 9, 18
    ws.add_chart(chart, "J2")


def _missing(value) -> bool:
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def _plain(value):
    """numpy scalars -> Python scalars for openpyxl."""
    return value.item() if hasattr(value, "item") else value
