"""A result table as its rows: what the reference-free compare builds, and what its CSV report
and terminal summary read without pandas (0.15 s of CPU to import: a third of a small dump's
whole command). ``frame()`` gives the pandas DataFrame the API, the XLSX report and the other
modes use, built on first use; from then on the DataFrame is the table (a change made to it is
what every reader sees).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

# the kinds of value text_rows writes as pandas does (numpy's float32 and int32 are not: pandas
# keeps or widens their column by rules of its own)
PLAIN = (type(None), bool, int, float, str, np.bool_, np.int64, np.float64)
INT64 = (-(2**63), 2**63 - 1)  # a larger int makes its column hold objects


class Table:
    """Rows (dicts) under fixed columns; ``whole_numbers``: columns pandas holds as nullable
    integers (Int64: a missing value stays empty instead of turning the column to floats)."""

    def __init__(self, columns: Sequence[str], rows: Iterable[dict],
                 whole_numbers: Sequence[str] = ()):
        self.columns = list(columns)
        self.whole_numbers = tuple(whole_numbers)
        self._rows = [dict(r) for r in rows]
        self._frame: pd.DataFrame | None = None

    @classmethod
    def of(cls, table: Table | pd.DataFrame) -> Table:
        """``table`` itself, or a DataFrame as a table (the DataFrame is the table)."""
        if isinstance(table, Table):
            return table
        out = cls(list(table.columns), [])
        out._frame = table
        return out

    @property
    def rows(self) -> list[dict]:
        """The rows (a copy of the DataFrame's once it exists)."""
        return self._rows if self._frame is None else self._frame.to_dict("records")

    @rows.setter
    def rows(self, rows: Iterable[dict]) -> None:
        self._rows, self._frame = [dict(r) for r in rows], None

    def __len__(self) -> int:
        return len(self._rows) if self._frame is None else len(self._frame)

    @property
    def empty(self) -> bool:
        return len(self) == 0

    @property
    def has_frame(self) -> bool:
        """The DataFrame exists (given, or built by an earlier ``frame()``)."""
        return self._frame is not None

    def column(self, name: str) -> list[Any]:
        if self._frame is not None:
            return list(self._frame[name])
        return [r.get(name) for r in self._rows]

    def frame(self) -> pd.DataFrame:
        """The table as a DataFrame (built once)."""
        if self._frame is None:
            import pandas as pd

            df = pd.DataFrame(self._rows, columns=self.columns)
            for col in self.whole_numbers:
                df[col] = df[col].astype("Int64")
            self._frame = df
        return self._frame

    def text_rows(self, cell: Callable[[Any], Any] = lambda v: v) -> list[list[str]] | None:
        """Every cell, passed through ``cell`` (text to text), as ``DataFrame.to_csv`` writes
        it (an empty cell for a missing value), by the kind pandas infers for each column
        from its values. None when that is not sure: the DataFrame exists, or a value's column
        pandas types by rules of its own (a numpy float32 among float64 values, an int beyond
        int64, a fraction in a whole-number column)."""
        if self._frame is not None or not all(
                type(v) in PLAIN and (type(v) is not int or INT64[0] <= v <= INT64[1])
                for r in self._rows for v in r.values()):
            return None
        rows = [{k: cell(v) for k, v in r.items()} for r in self._rows]
        columns = []
        for name in self.columns:
            values = [r.get(name) for r in rows]
            if name in self.whole_numbers:
                if any(not missing(v) and v != int(v) for v in values):
                    return None
                columns.append(["" if missing(v) else str(int(v)) for v in values])
            else:
                columns.append(_texts(values))
        return [list(row) for row in zip(*columns)] if columns else [[] for _ in rows]


def _texts(values: list[Any]) -> list[str]:
    kind = column_kind(values)
    if kind == "float":
        return ["" if missing(v) else repr(float(v)) for v in values]
    if kind == "int":
        return [str(int(v)) for v in values]
    return ["" if missing(v) else str(v) for v in values]


def column_kind(values: list[Any]) -> str:
    """The dtype pandas gives a column of these plain values (``PLAIN``): "int" (every value
    an integer), "float" (numbers, at least one a float or missing), "bool" (every value a
    bool) or "object" (anything else: text, mixed kinds, nothing but missing values)."""
    present = [v for v in values if not missing(v)]
    if not present:
        return "object"
    if all(isinstance(v, (bool, np.bool_)) for v in present):
        return "bool" if len(present) == len(values) else "object"
    if not all(isinstance(v, (int, float, np.int64)) and not isinstance(v, bool)
               for v in present):
        return "object"
    if len(present) == len(values) and all(isinstance(v, (int, np.int64)) for v in present):
        return "int"
    return "float"


def missing(v: Any) -> bool:
    """None or a NaN: an empty cell."""
    return v is None or (isinstance(v, float) and math.isnan(v))  # np.float64 is a float
