"""CSV output: the layers table at the given path, the file table at ``<stem>.files.csv``."""

from __future__ import annotations

import os

import pandas as pd

from .table import escape_formulas


def files_csv_path(csv_path: str) -> str:
    """``report.csv`` -> ``report.files.csv``, next to it."""
    stem, _ = os.path.splitext(csv_path)
    return stem + ".files.csv"


def write_csv(layers: pd.DataFrame, files: pd.DataFrame, path: str) -> list[str]:
    """Write both tables; returns the paths written (layers first)."""
    files_path = files_csv_path(path)
    # Escaped too: CSV files are opened in spreadsheet programs as often as XLSX.
    escape_formulas(layers).to_csv(path, index=False)
    escape_formulas(files).to_csv(files_path, index=False)
    return [path, files_path]
