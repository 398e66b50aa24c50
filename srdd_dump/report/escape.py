"""Formula escaping of every report table, CSV and XLSX alike: CSV files are opened in
spreadsheet programs as often as XLSX. No openpyxl here (0.09 s of a CSV compare), and pandas
only for a DataFrame's escaping."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

# Spreadsheet programs run a cell that starts with one of these as a formula.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
# control characters an XLSX cell cannot hold (openpyxl refuses the whole report) and a
# terminal would act on (a module name of a crafted dump): each becomes U+FFFD
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# what a terminal acts on besides: carriage return (overwrites a line) and the C1 controls
# (U+009B opens an escape sequence as ESC [ does)
_TERMINAL_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def escape_formula(value):
    """Prefix a quote to a text that a spreadsheet would run as a formula, and replace the
    control characters it cannot hold; others unchanged."""
    if isinstance(value, str):
        if _CONTROL.search(value):
            value = _CONTROL.sub("\ufffd", value)
        if value.startswith(_FORMULA_START):
            return "'" + value
    return value


def for_terminal(text: str) -> str:
    """``text`` with every control character but tab and newline replaced by U+FFFD: a module
    or file name of a crafted dump reaches the terminal as text, never as an escape sequence."""
    return _TERMINAL_CONTROL.sub("\ufffd", text)


def escape_formulas(df: pd.DataFrame) -> pd.DataFrame:
    """Copy of ``df`` with every text cell passed through ``escape_formula``."""
    import pandas as pd

    out = df.copy()
    for col in out.columns:
        if not pd.api.types.is_numeric_dtype(out[col]):
            out[col] = out[col].map(escape_formula)
    return out
