"""A result table as its rows: what the reference-free compare builds, and what its CSV report
and terminal summary read without pandas (0.15 s of CPU to import: a third of a small dump's
whole command). ``frame()`` gives the pandas DataFrame the API, the XLSX report and the other
modes use, built on first use.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
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
        self.rows = [dict(r) for r in rows]
        self.whole_numbers = tuple(whole_numbers)
        self._frame: pd.DataFrame | None = None

    @classmethod
    def of_frame(cls, frame: pd.DataFrame) -> Table:
        """A table holding an existing DataFrame (its rows as ``to_dict`` gives them)."""
        table = cls(list(frame.columns), frame.to_dict("records"))
        table._frame = frame
        return table

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def empty(self) -> bool:
        return not self.rows

    @property
    def has_frame(self) -> bool:
        """The DataFrame exists already (given, or built by an earlier ``frame()``)."""
        return self._frame is not None

    def column(self, name: str) -> list[Any]:
        return [r.get(name) for r in self.rows]

    def frame(self) -> pd.DataFrame:
        """The table as a DataFrame (built once)."""
        if self._frame is None:
            import pandas as pd

            df = pd.DataFrame(self.rows, columns=self.columns)
            for col in self.whole_numbers:
                df[col] = df[col].astype("Int64")
            self._frame = df
        return self._frame

    def text_rows(self) -> list[list[str]] | None:
        """Every cell as ``DataFrame.to_csv`` writes it (an empty cell for a missing value),
        by the kind pandas infers for each column from its values; None when a value is of a
        kind whose column pandas infers otherwise (a numpy float32 among float64 values):
        then only the DataFrame's own ``to_csv`` is sure."""
        if not all(type(v) in PLAIN and (type(v) is not int or INT64[0] <= v <= INT64[1])
                   for r in self.rows for v in r.values()):
            return None
        columns = [self._texts(name) for name in self.columns]
        return [list(row) for row in zip(*columns)] if columns else [[] for _ in self.rows]

    def _texts(self, name: str) -> list[str]:
        values = self.column(name)
        if name in self.whole_numbers:
            return ["" if _missing(v) else str(int(v)) for v in values]
        kind = column_kind(values)
        if kind == "float":
            return ["" if _missing(v) else _float_text(v) for v in values]
        if kind == "int":
            return [str(int(v)) for v in values]
        return ["" if _missing(v) else str(v) for v in values]


def column_kind(values: list[Any]) -> str:
    """The dtype pandas gives a column of these Python values: "int" (every value an integer),
    "float" (numbers, at least one a float or missing), "bool" (every value a bool) or
    "object" (anything else: text, mixed kinds, nothing but missing values)."""
    present = [v for v in values if not _missing(v)]
    if not present:
        return "object"
    if all(_is_bool(v) for v in present):
        return "bool" if len(present) == len(values) else "object"
    if any(_is_bool(v) or not _is_number(v) for v in present):
        return "object"
    if len(present) == len(values) and all(_is_int(v) for v in present):
        return "int"
    return "float"


def _float_text(v: Any) -> str:
    """A number as pandas writes it in a float64 column."""
    return repr(float(v))


def _missing(v: Any) -> bool:
    if v is None or type(v).__name__ == "NAType":  # pandas.NA, from an Int64 column
        return True
    try:
        return isinstance(v, float) and math.isnan(v) or (
            type(v).__module__ == "numpy" and v != v)  # a numpy NaN scalar
    except (TypeError, ValueError):
        return False


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool) or type(v).__name__ == "bool_"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) or (type(v).__module__ == "numpy" and
                                  type(v).__name__.startswith(("int", "uint")))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) or (
        type(v).__module__ == "numpy" and type(v).__name__.startswith(("int", "uint", "float")))
