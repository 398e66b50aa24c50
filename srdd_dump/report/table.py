"""The two report tables: one row per (file, layer), and one row per input file."""

from __future__ import annotations

import math

import pandas as pd

from ..analysis.diagnosis import VERDICT_ORDER, LayerVerdict
from ..analysis.signals import Signals

BASE_COLUMNS = [
    "source", "layer", "module", "score", "verdict", "diagnosis", "mean", "std", "absmax",
    "kurtosis", "zero_frac", "nan_count", "inf_count", "samples",
]
SIGNAL_COLUMNS = [
    "kurt_change", "gain", "gain_spread", "linearity", "dc_dead", "dc_low", "instability",
    "instab_changed", "batch_dep", "ties", "pileup", "offset", "dc_energy", "stuck", "lowbits",
    "update_rms",
]
LAYER_COLUMNS = BASE_COLUMNS + SIGNAL_COLUMNS + ["site", "evidence", "rank", "pid"]
SITE_COLUMNS = ["source", "layer", "module"] + BASE_COLUMNS[6:] + SIGNAL_COLUMNS + ["rank", "pid"]
FILE_COLUMNS = ["source", "status", "reason", "rounds", "samples", "layers", "rank", "pid"]

OK = "ok"
INCOMPLETE = "incomplete"
SKIPPED = "skipped"

# Spreadsheet programs run a cell that starts with one of these as a formula.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def layer_row(
    source: str,
    sig: Signals,
    verdict: LayerVerdict,
    rank: int | None = None,
    pid: int | None = None,
) -> dict:
    """A block layer's row: its verdict and its block-level signals."""
    row = {k: v for k, v in sig.as_dict().items() if k in LAYER_COLUMNS}
    row.update(
        source=source, layer=verdict.layer, module=sig.module, score=round(verdict.score, 4),
        verdict=verdict.verdict, diagnosis=verdict.diagnosis, site=verdict.site,
        evidence=verdict.explain(), rank=rank, pid=pid,
    )
    if not sig.samples:
        row["absmax"] = math.nan
    return row


def site_row(source: str, sig: Signals, rank: int | None = None, pid: int | None = None) -> dict:
    row = {k: v for k, v in sig.as_dict().items() if k in SITE_COLUMNS}
    row.update(source=source, rank=rank, pid=pid)
    return row


def sites_table(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=SITE_COLUMNS)
    for col in ("rank", "pid"):
        df[col] = df[col].astype("Int64")
    return df.sort_values(["source", "layer", "module"], kind="mergesort").reset_index(drop=True)


def layers_table(rows: list[dict]) -> pd.DataFrame:
    """Rows sorted most suspicious first: verdict, then score descending, source, layer."""
    df = pd.DataFrame(rows, columns=LAYER_COLUMNS)
    for col in ("rank", "pid"):
        df[col] = df[col].astype("Int64")
    if df.empty:
        return df
    order = df["verdict"].map(VERDICT_ORDER).fillna(len(VERDICT_ORDER))
    df = df.assign(_order=order).sort_values(
        ["_order", "score", "source", "layer"],
        ascending=[True, False, True, True],
        kind="mergesort",
    )
    return df.drop(columns="_order").reset_index(drop=True)


def files_table(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=FILE_COLUMNS)
    for col in ("rounds", "samples", "layers", "rank", "pid"):
        df[col] = df[col].astype("Int64")
    return df


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
