"""The two report tables: one row per (file, layer), and one row per input file."""

from __future__ import annotations

import math

import pandas as pd

from ..analysis.basic import VERDICT_ORDER
from ..analysis.moments import Moments

LAYER_COLUMNS = [
    "source", "layer", "module", "score", "verdict", "diagnosis", "mean", "std", "absmax",
    "kurtosis", "zero_frac", "nan_count", "inf_count", "samples", "rank", "pid",
]
FILE_COLUMNS = ["source", "status", "reason", "rounds", "samples", "layers", "rank", "pid"]

OK = "ok"
INCOMPLETE = "incomplete"
SKIPPED = "skipped"

# Spreadsheet programs run a cell that starts with one of these as a formula.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def layer_row(
    source: str,
    layer: int,
    module: str,
    stats: Moments,
    judged: tuple[float, str, str],
    samples: int,
    rank: int | None = None,
    pid: int | None = None,
) -> dict:
    score, verdict, diagnosis = judged
    return {
        "source": source, "layer": layer, "module": module, "score": score,
        "verdict": verdict, "diagnosis": diagnosis, "mean": stats.mean, "std": stats.std,
        "absmax": stats.absmax if stats.count else math.nan, "kurtosis": stats.kurtosis,
        "zero_frac": stats.zero_frac, "nan_count": stats.nan_count,
        "inf_count": stats.inf_count, "samples": samples, "rank": rank, "pid": pid,
    }


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
