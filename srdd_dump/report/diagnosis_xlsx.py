"""Reference-free report as XLSX: summary, per-layer table (coloured by verdict), signals by
layer with native line charts, sub-layer signals and the input files. A table whose columns a
user of the API changed (``result.layers`` filtered, a column dropped) is written as it is: a
part that needs a missing column is left out."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from openpyxl.chart import LineChart, Reference
from openpyxl.formatting.rule import CellIsRule, ColorScaleRule
from openpyxl.styles import Alignment, Font, PatternFill
from openpyxl.utils import get_column_letter

from ..analysis.verdicts import FAULT, NORMAL, SUSPECT, VERDICT_ORDER
from ..compare.results import CompareResult
from .escape import escape_formula, escape_formulas
from .sheets import format_table
from .terminal import consistency_text, hunt_line

SUMMARY_SHEET = "summary"
LAYERS_SHEET = "layers"
SIGNALS_SHEET = "signals"
SITES_SHEET = "sublayers"
FILES_SHEET = "files"
FILLS = {
    FAULT: PatternFill(fill_type="solid", start_color="FFFFC7CE", end_color="FFFFC7CE"),  # red
    SUSPECT: PatternFill(fill_type="solid", start_color="FFFFEB9C", end_color="FFFFEB9C"),
}
# Per-layer signals charted against the layer index (one chart each, one line per source).
CHARTED = ("score", "gain", "kurtosis", "instability", "zero_frac", "offset", "ties")
# the summary's row per flagged layer
WORST_SHOWN = ("source", "layer", "verdict", "diagnosis", "score", "evidence")
MAX_CHART_SOURCES = 8


def write_xlsx(result: CompareResult, path: str) -> list[str]:
    """Write a CompareResult to one workbook; returns ``[path]``."""
    layers = result.layers
    # a Path: pandas refuses a str path whose extension is not lower case (R.XLSX)
    with pd.ExcelWriter(Path(path), engine="openpyxl") as xw:
        _summary(xw, result)
        escape_formulas(layers).to_excel(xw, sheet_name=LAYERS_SHEET, index=False)
        _colour_layers(xw.sheets[LAYERS_SHEET], layers)
        _signals(xw, layers)
        if len(result.sites):
            escape_formulas(result.sites).to_excel(xw, sheet_name=SITES_SHEET, index=False)
        escape_formulas(result.files).to_excel(xw, sheet_name=FILES_SHEET, index=False)
        for name, df in ((LAYERS_SHEET, layers), (SITES_SHEET, result.sites),
                         (FILES_SHEET, result.files)):
            if name not in xw.sheets:
                continue
            sheet = xw.sheets[name]
            format_table(sheet, df)
    return [path]


def _summary(xw: pd.ExcelWriter, result: CompareResult) -> None:
    pd.DataFrame().to_excel(xw, sheet_name=SUMMARY_SHEET, index=False)
    ws = xw.sheets[SUMMARY_SHEET]
    ws["A1"] = "srdd-compare verdict"
    ws["A1"].font = Font(bold=True, size=14)
    row = 3
    for line in result.headlines or ["no layer rows"]:
        cell = ws.cell(row=row, column=1, value=escape_formula(line))
        cell.font = Font(bold=True)
        row += 1
    for hunt in result.hunts:
        ws.cell(row=row, column=1, value=escape_formula(hunt_line(hunt)))
        row += 1
    if result.consistency is not None:
        row += 1
        for line in consistency_text(result.consistency).splitlines():
            ws.cell(row=row, column=1, value=escape_formula(line))
            row += 1
    if result.missing_evidence:
        row += 1
        ws.cell(row=row, column=1, value="evidence missing from these verdicts").font = Font(
            bold=True)
        row += 1
        for line in result.missing_evidence:
            ws.cell(row=row, column=1, value=escape_formula(line))
            row += 1
    if result.notes:  # what the terminal said on stderr: what the dumps lack, runs chosen...
        row += 1
        ws.cell(row=row, column=1, value="notes").font = Font(bold=True)
        row += 1
        for note in result.notes:
            ws.cell(row=row, column=1, value=escape_formula(note))
            row += 1
    row += 1
    layers = result.layers
    verdicts = layers["verdict"] if "verdict" in layers else pd.Series([], dtype=object)
    counts = verdicts.value_counts()
    for verdict in VERDICT_ORDER:
        ws.cell(row=row, column=1, value=verdict).font = Font(bold=True)
        ws.cell(row=row, column=2, value=int(counts.get(verdict, 0)))
        if verdict in FILLS:
            ws.cell(row=row, column=1).fill = FILLS[verdict]
        row += 1
    row += 1
    if "status" in result.files:
        status = result.files["status"].value_counts()
        ws.cell(row=row, column=1, value="files")
        ws.cell(row=row, column=2, value=", ".join(f"{n} {k}" for k, n in status.items()))
    row += 2
    worst = layers[verdicts != NORMAL].head(10) if "verdict" in layers else layers.head(0)
    shown = [c for c in WORST_SHOWN if c in layers]
    if len(worst):
        ws.cell(row=row, column=1, value="most suspicious layers").font = Font(bold=True)
        row += 1
        for _, r in worst.iterrows():
            for col, name in enumerate(shown, start=1):
                cell = ws.cell(row=row, column=col, value=_cell(r[name]))
                if name == "verdict" and r[name] in FILLS:  # a verdict the user wrote: plain
                    cell.fill = FILLS[r[name]]
            row += 1
    ws.column_dimensions["A"].width = 100
    for col in "BCDE":
        ws.column_dimensions[col].width = 14
    ws["A1"].alignment = Alignment(wrap_text=False)


def _cell(value):
    """A table value as a summary cell: a text escaped, nothing for a missing value."""
    if isinstance(value, str):
        return escape_formula(value)
    if pd.isna(value):
        return None
    return value.item() if hasattr(value, "item") else value


def _colour_layers(ws, layers: pd.DataFrame) -> None:
    if "verdict" not in layers:
        return
    verdict_col = list(layers.columns).index("verdict")
    for i, verdict in enumerate(layers["verdict"], start=2):  # row 1 is the header
        fill = FILLS.get(verdict)
        if fill is not None:
            for cell in ws[i]:
                cell.fill = fill
            ws.cell(row=i, column=verdict_col + 1).font = Font(bold=True)
    n = len(layers) + 1
    if n < 2:
        return
    cols = list(layers.columns)
    if "score" in cols:
        score = get_column_letter(cols.index("score") + 1)
        ws.conditional_formatting.add(
            f"{score}2:{score}{n}",
            ColorScaleRule(start_type="num", start_value=0, start_color="FFFFFFFF",
                           end_type="num", end_value=1, end_color="FFF8696B"),
        )
    for name in ("nan_count", "inf_count"):
        if name not in cols:
            continue
        col = get_column_letter(cols.index(name) + 1)
        ws.conditional_formatting.add(
            f"{col}2:{col}{n}",
            CellIsRule(operator="greaterThan", formula=["0"], fill=FILLS[FAULT]),
        )


def _signals(xw: pd.ExcelWriter, layers: pd.DataFrame) -> None:
    """A layer-ordered table (one column per source and signal) and a line chart per signal."""
    charted = [c for c in CHARTED if c in layers]
    if not charted or "source" not in layers or "layer" not in layers:
        return
    sources = list(dict.fromkeys(layers["source"]))[:MAX_CHART_SOURCES]
    by_layer = layers[layers["source"].isin(sources)].sort_values(["source", "layer"])
    wide = by_layer.pivot_table(index="layer", columns="source", values=charted)
    table = pd.DataFrame({"layer": wide.index})
    for signal in charted:
        for src in sources:
            key = (signal, src)
            table[f"{signal} | {src}"] = wide[key].values if key in wide else float("nan")
    escape_formulas(table).to_excel(xw, sheet_name=SIGNALS_SHEET, index=False)
    ws = xw.sheets[SIGNALS_SHEET]
    n = len(table) + 1
    anchor_col = get_column_letter(len(table.columns) + 2)
    for k, signal in enumerate(charted):
        chart = LineChart()
        chart.title = f"{signal} by layer"
        chart.x_axis.title = "layer"
        chart.y_axis.title = signal
        chart.height, chart.width = 7, 16
        first = 2 + k * len(sources)
        data = Reference(ws, min_col=first, max_col=first + len(sources) - 1, min_row=1, max_row=n)
        chart.add_data(data, titles_from_data=True)
        chart.set_categories(Reference(ws, min_col=1, min_row=2, max_row=n))
        ws.add_chart(chart, f"{anchor_col}{1 + k * 15}")


