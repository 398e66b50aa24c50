"""Offline comparison: read every dump file under a path, judge each layer, write the report.

numpy + h5py + pandas only: this module (and everything it imports) must never import torch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pandas as pd
from tqdm import tqdm

from .analysis.basic import judge
from .analysis.moments import Moments
from .errors import UserError
from .format import schema as s
from .format.reader import DumpError, DumpReader, find_dump_files
from .report.csvfile import write_csv
from .report.excel import write_xlsx
from .report.table import INCOMPLETE, OK, SKIPPED, files_table, layer_row, layers_table

WRITERS: dict[str, Callable[[pd.DataFrame, pd.DataFrame, str], list[str]]] = {
    ".csv": write_csv,
    ".xlsx": write_xlsx,
}

# What a damaged HDF5 file can raise while its data is read (after it opened and validated).
_READ_ERRORS = (OSError, KeyError, ValueError, RuntimeError)


@dataclass
class CompareResult:
    path: str  # what was compared, as given
    layers: pd.DataFrame  # report.table.LAYER_COLUMNS, most suspicious first
    files: pd.DataFrame  # report.table.FILE_COLUMNS, one row per dump file found
    written: list[str] = field(default_factory=list)  # report files, empty if no output

    def count(self, status: str) -> int:
        return int((self.files["status"] == status).sum())

    @property
    def skipped_reasons(self) -> list[str]:
        return list(self.files.loc[self.files["status"] == SKIPPED, "reason"])


def compare_path(
    path: str, output: str | None = None, *, progress: bool | None = None
) -> CompareResult:
    """Compare every dump file (``*.h5``, ``*.h5.partial``) under ``path`` (a folder or a file).

    ``output`` ending in ``.csv`` or ``.xlsx`` selects the report format; None writes nothing.
    Unreadable files are skipped with their reason in the file table; files cut short by a
    crash are used and marked incomplete. ``progress`` (default: stderr is a terminal) shows
    tqdm bars. Raises UserError when there is nothing usable to report.
    """
    write = _writer_for(output) if output is not None else None
    if not os.path.exists(path):
        raise UserError(f"{path}: no such file or directory")
    found = find_dump_files(path)
    if not found:
        raise UserError(f"{path}: no dump files (*.h5 or *.h5.partial) found")
    show = sys.stderr.isatty() if progress is None else progress
    root = path if os.path.isdir(path) else os.path.dirname(path)

    layer_rows: list[dict] = []
    file_rows: list[dict] = []
    for file in tqdm(found, desc="files", unit="file", disable=not show, leave=False):
        source = os.path.relpath(file, root) if root else file
        rows, file_row = _compare_file(file, source, show)
        layer_rows.extend(rows)
        file_rows.append(file_row)

    files = files_table(file_rows)
    if not layer_rows:
        reason = file_rows[0]["reason"]
        if len(found) == 1:
            raise UserError(reason)
        raise UserError(f"none of the {len(found)} dump files under {path} is usable; {reason}")
    result = CompareResult(path=path, layers=layers_table(layer_rows), files=files)
    if write is not None:
        result.written = _write(write, result, output)
    return result


def _writer_for(output: str) -> Callable[[pd.DataFrame, pd.DataFrame, str], list[str]]:
    ext = os.path.splitext(output)[1].lower()
    if ext not in WRITERS:
        raise UserError(
            f"{output}: unknown report format {ext or '(no extension)'!r}; use .csv or .xlsx"
        )
    return WRITERS[ext]


def _write(write, result: CompareResult, output: str) -> list[str]:
    try:
        parent = os.path.dirname(os.path.abspath(output))
        os.makedirs(parent, exist_ok=True)
        return write(result.layers, result.files, output)
    except OSError as exc:
        raise UserError(f"{output}: cannot write the report ({exc.strerror or exc})") from exc


def _compare_file(file: str, source: str, show: bool) -> tuple[list[dict], dict]:
    """Layer rows of one file and its row of the file table; never raises for a bad file."""
    try:
        reader = DumpReader(file)
    except DumpError as exc:
        return [], _file_row(source, SKIPPED, str(exc))
    with reader:
        rank, pid = _int_or_none(reader.meta.get("rank")), _int_or_none(reader.meta.get("pid"))
        try:
            rows = _layer_rows(reader, source, rank, pid, show)
        except _READ_ERRORS as exc:
            reason = f"{file}: damaged dump file ({_first_line(exc)})"
            return [], _file_row(source, SKIPPED, reason, rank=rank, pid=pid)
        counts = dict(
            rounds=len(reader.rounds), samples=reader.n_samples, layers=len(rows), rank=rank,
            pid=pid,
        )
        if not rows:
            why = "no captured layer data" + ("" if reader.complete else " (incomplete file)")
            return [], _file_row(source, SKIPPED, f"{file}: {why}", **counts)
        if not reader.complete:
            return rows, _file_row(source, INCOMPLETE, _incomplete_reason(reader), **counts)
        return rows, _file_row(source, OK, "", **counts)


def _layer_rows(
    reader: DumpReader, source: str, rank: int | None, pid: int | None, show: bool
) -> list[dict]:
    """One row per block layer (0..L-1) with clean records; the stack input (-1) is left out."""
    sample_of = dict(zip(reader.rounds["round"].tolist(), reader.rounds["sample"].tolist()))
    clean = reader.select(kind=s.KIND_CLEAN)
    # Records whose round row was never written were cut off by a crash: not trusted.
    clean = clean[np.isin(clean["round"], reader.rounds["round"])]
    layers = sorted({int(x) for x in clean["layer"] if x >= 0})
    rows = []
    for layer in tqdm(layers, desc=source, unit="layer", disable=not show, leave=False):
        stats, samples = Moments(), set()
        for rec in clean[clean["layer"] == layer]:
            stats.add(reader.read(rec))
            samples.add(sample_of[int(rec["round"])])
        module = reader.layers[layer] if layer < len(reader.layers) else ""
        rows.append(
            layer_row(source, layer, module, stats, judge(stats), len(samples), rank, pid)
        )
    return rows


def _file_row(source: str, status: str, reason: str, **counts) -> dict:
    return {"source": source, "status": status, "reason": reason, **counts}


def _incomplete_reason(reader: DumpReader) -> str:
    if reader.path.endswith(s.PARTIAL_SUFFIX):
        why = "capture did not finish (.partial file)"
    else:
        why = "capture did not finish cleanly"
    error = reader.status.get("error") or reader.status.get("write_error")
    if error:
        why += f": {_first_line(error)}"
    return f"{why}; the {len(reader.rounds)} rounds written were used"


def _int_or_none(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _first_line(what) -> str:
    lines = str(what).strip().splitlines()
    return lines[0] if lines else type(what).__name__
