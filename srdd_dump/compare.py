"""Offline comparison: read every dump file under a path, diagnose each layer, write the report.

numpy + h5py + pandas only: this module (and everything it imports) must never import torch.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import BrokenExecutor
from dataclasses import dataclass, field

import pandas as pd
from tqdm import tqdm

from .analysis.diagnosis import FAULT, NORMAL, SUSPECT, diagnose, headline
from .analysis.signals import file_signals
from .errors import UserError, first_line
from .format import schema as s
from .format.reader import DumpError, DumpReader, find_dump_files
from .pool import spawn_pool
from .report.table import (
    INCOMPLETE,
    OK,
    SKIPPED,
    files_table,
    layer_row,
    layers_table,
    site_row,
    sites_table,
)

# What a damaged HDF5 file can raise while its data is read (after it opened and validated).
_READ_ERRORS = (OSError, KeyError, ValueError, RuntimeError)
REPORT_FORMATS = (".csv", ".xlsx")


@dataclass
class CompareResult:
    path: str  # what was compared, as given
    layers: pd.DataFrame  # report.table.LAYER_COLUMNS, most suspicious first
    files: pd.DataFrame  # report.table.FILE_COLUMNS, one row per dump file found
    sites: pd.DataFrame = field(default_factory=lambda: sites_table([]))  # sub-layer signals
    headlines: list[str] = field(default_factory=list)  # one verdict sentence per source
    written: list[str] = field(default_factory=list)  # report files, empty if no output
    consistency: object = None  # consistency.ConsistencyResult when 3+ cards ran the same inputs

    def count(self, status: str) -> int:
        return int((self.files["status"] == status).sum())

    @property
    def skipped_reasons(self) -> list[str]:
        return list(self.files.loc[self.files["status"] == SKIPPED, "reason"])

    def worst_verdict(self) -> str:
        verdicts = set(self.layers["verdict"])
        return next((v for v in (FAULT, SUSPECT) if v in verdicts), NORMAL)


@dataclass
class _FileResult:
    file_row: dict
    layer_rows: list[dict] = field(default_factory=list)
    site_rows: list[dict] = field(default_factory=list)
    headline: str = ""


def compare_path(
    path: str, output: str | None = None, *, progress: bool | None = None, jobs: int = 1
) -> CompareResult:
    """Compare every dump file (``*.h5``, ``*.h5.partial``) under ``path`` (a folder or a file).

    ``output`` ending in ``.csv`` or ``.xlsx`` selects the report format; None writes nothing.
    Unreadable files are skipped with their reason in the file table; files cut short by a
    crash are used and marked incomplete. ``progress`` (default: stderr is a terminal) shows
    tqdm bars. ``jobs`` > 1 splits each file's layers among that many processes (this one and
    ``jobs - 1`` spawned workers). Raises UserError when there is nothing usable to report.
    """
    if jobs < 1:
        raise UserError(f"--jobs {jobs}: must be at least 1")
    if output is not None:
        _check_format(output)
    if not os.path.exists(path):
        raise UserError(f"{path}: no such file or directory")
    found = find_dump_files(path)
    if not found:
        raise UserError(f"{path}: no dump files (*.h5 or *.h5.partial) found")
    show = sys.stderr.isatty() if progress is None else progress
    root = path if os.path.isdir(path) else os.path.dirname(path)

    results = []
    pool = _Pool(jobs)
    try:
        for file in tqdm(found, desc="files", unit="file", disable=not show, leave=False):
            source = os.path.relpath(file, root) if root else file
            results.append(_compare_file(file, source, show, pool))
    finally:
        pool.close()

    layer_rows = [row for r in results for row in r.layer_rows]
    if not layer_rows:
        reason = results[0].file_row["reason"]
        if len(found) == 1:
            raise UserError(reason)
        raise UserError(f"none of the {len(found)} dump files under {path} is usable; {reason}")
    result = CompareResult(
        path=path,
        layers=layers_table(layer_rows),
        files=files_table([r.file_row for r in results]),
        sites=sites_table([row for r in results for row in r.site_rows]),
        headlines=[r.headline for r in results if r.headline],
    )
    from .consistency import check_consistency

    result.consistency = check_consistency(found, root)
    if output is not None:
        result.written = write_report(result, output)
        if result.consistency is not None:
            from .report.consistency_report import write_consistency

            extra = write_consistency(result.consistency, output)
            result.written += [p for p in extra if p not in result.written]
    return result


def write_report(result: CompareResult, output: str) -> list[str]:
    """Write the report in the format named by the extension; returns the files written."""
    # only the writer asked for: openpyxl alone takes 0.16 s to import
    if _check_format(output) == ".csv":
        from .report.csvfile import write_csv as write
    else:
        from .report.excel import write_xlsx as write
    try:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        return write(result, output)
    except OSError as exc:
        raise UserError(f"{output}: cannot write the report ({exc.strerror or exc})") from exc


def _check_format(output: str) -> str:
    ext = os.path.splitext(output)[1].lower()
    if ext not in REPORT_FORMATS:
        raise UserError(
            f"{output}: unknown report format {ext or '(no extension)'!r}; use .csv or .xlsx"
        )
    return ext


class _Pool:
    """Worker processes shared by the files of one compare, made on first use; a pool broken
    by a worker that died is replaced for the next file."""

    def __init__(self, jobs: int):
        self.jobs = jobs
        self.executor = None

    def get(self):
        if self.jobs <= 1:
            return None
        if self.executor is None:
            self.executor = spawn_pool(self.jobs - 1)
        return self.executor

    def broken(self) -> None:
        self.close()

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(cancel_futures=True)
            self.executor = None


def _compare_file(file: str, source: str, show: bool, pool: _Pool | None = None) -> _FileResult:
    """Rows of one file; never raises for a bad file (it becomes a skipped row)."""
    try:
        reader = DumpReader(file)
    except DumpError as exc:
        return _FileResult(_file_row(source, SKIPPED, str(exc)))
    with reader:
        rank, pid = reader.meta_int("rank"), reader.meta_int("pid")
        try:
            result = _diagnose_file(reader, source, rank, pid, show, pool)
        except _READ_ERRORS as exc:
            reason = f"{file}: damaged dump file ({first_line(exc)})"
            if isinstance(exc, BrokenExecutor):
                if pool is not None:
                    pool.broken()
                # a crash inside HDF5 on a damaged file, or the worker could not start
                reason = (f"{file}: a compare worker process died while reading it (damaged "
                          "file? out of memory? or, from Python code, compare_path(jobs>1) "
                          "called outside `if __name__ == '__main__':`)")
            return _FileResult(_file_row(source, SKIPPED, reason, rank=rank, pid=pid))
        counts = dict(
            rounds=len(reader.rounds), samples=reader.n_samples, layers=len(result.layer_rows),
            rank=rank, pid=pid,
        )
        if not result.layer_rows:
            why = "no captured layer data" + ("" if reader.complete else " (incomplete file)")
            result.file_row = _file_row(source, SKIPPED, f"{file}: {why}", **counts)
        elif not reader.complete:
            result.file_row = _file_row(source, INCOMPLETE, _incomplete_reason(reader), **counts)
        else:
            result.file_row = _file_row(source, OK, "", **counts)
        return result


def _diagnose_file(
    reader: DumpReader, source: str, rank: int | None, pid: int | None, show: bool,
    pool: _Pool | None = None,
) -> _FileResult:
    """Signals of every block and sub-layer, then one verdict row per block layer."""
    jobs = pool.jobs if pool is not None else 1
    executor = pool.get() if pool is not None else None
    signals = file_signals(reader, progress=show, desc=source, jobs=jobs, pool=executor)
    blocks = {g.layer: g for g in signals if g.site == s.BLOCK_SITE and g.samples}
    result = _FileResult(file_row={})
    if not blocks:
        return result
    dtype = str(reader.meta.get("hidden_dtype") or _first_dtype(reader))
    verdicts = diagnose(signals, dtype, n_layers=max(len(reader.layers), max(blocks) + 1))
    for v in verdicts:
        if v.layer in blocks:
            v.module = blocks[v.layer].module
            result.layer_rows.append(layer_row(source, blocks[v.layer], v, rank, pid))
    result.site_rows = [
        site_row(source, g, rank, pid) for g in signals if g.site != s.BLOCK_SITE and g.samples
    ]
    worst = max(verdicts, key=lambda v: v.score)
    if worst.verdict == NORMAL:
        result.headline = f"{source}: no faulty layer found (highest score {worst.score:.2f}, " \
                          f"layer {worst.layer})"
    else:
        result.headline = f"{source}: {headline(worst)}"
    return result


def _first_dtype(reader: DumpReader) -> str:
    clean = reader.select(kind=s.KIND_CLEAN)
    return reader.dtype_of(clean[0]) if len(clean) else "float32"


def _file_row(source: str, status: str, reason: str, **counts) -> dict:
    return {"source": source, "status": status, "reason": reason, **counts}


def _incomplete_reason(reader: DumpReader) -> str:
    if reader.path.endswith(s.PARTIAL_SUFFIX):
        why = "capture did not finish (.partial file)"
    else:
        why = "capture did not finish cleanly"
    error = reader.status.get("error") or reader.status.get("write_error")
    if error:
        why += f": {first_line(error)}"
    return f"{why}; the {len(reader.rounds)} rounds written were used"

