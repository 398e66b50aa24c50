"""Render compare results: CSV, XLSX or terminal text. One dispatch on the report's extension
(``write_report``); the writers import openpyxl only for XLSX (0.16 s of a CSV compare)."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

from ..errors import UserError

if TYPE_CHECKING:  # the result modules: not before a compare has run
    from ..compare.results import BaselineResult, CompareResult

REPORT_FORMATS = (".csv", ".xlsx")


def report_format(output: str) -> str:
    """The report format of a path: ".csv" or ".xlsx"; UserError for anything else."""
    ext = os.path.splitext(output)[1].lower()
    if ext not in REPORT_FORMATS:
        raise UserError(
            f"{output}: unknown report format {ext or '(no extension)'!r}; use .csv or .xlsx"
        )
    return ext


def write_report(result: CompareResult | BaselineResult, output: str) -> list[str]:
    """Write ``result`` in the format of ``output``'s extension; returns the files written
    (the main report first). The files are written in a folder beside ``output`` first and
    moved into place when all are whole: a write that fails (a full disk) leaves the reports
    already there as they were, never a truncated one."""
    ext = report_format(output)
    folder = os.path.dirname(os.path.abspath(output))
    stage = None
    try:
        os.makedirs(folder, exist_ok=True)
        stage = tempfile.mkdtemp(prefix=".srdd-report-", dir=folder)
        staged = _write(result, os.path.join(stage, os.path.basename(output)), ext)
        written = [os.path.join(os.path.dirname(output), os.path.basename(p)) for p in staged]
        for target in written:  # before any is replaced: all or none
            if os.path.isdir(target):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), target)
        for source, target in zip(staged, written):
            os.replace(source, target)
    except OSError as exc:
        raise UserError(f"{_failed_file(exc, stage, output)}: cannot write the report "
                        f"({_why(exc, folder)})") from exc
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
    if ext == ".csv":
        _remove_stale(output, written)
    return written


def _write(result: CompareResult | BaselineResult, path: str, ext: str) -> list[str]:
    from ..compare.results import BaselineResult

    if isinstance(result, BaselineResult):
        if ext == ".csv":
            from .baseline_csv import write_csv as write_baseline
        else:
            from .baseline_xlsx import write_xlsx as write_baseline
        return write_baseline(result, path)
    if ext == ".csv":
        from .diagnosis_csv import write_csv as write
    else:
        from .diagnosis_xlsx import write_xlsx as write
    written = write(result, path)
    if result.consistency is not None:
        from .consistency import write_consistency

        extra = write_consistency(result.consistency, path)
        written += [p for p in extra if p not in written]
    return written


def _remove_stale(output: str, written: list[str]) -> None:
    """The CSV tables of an earlier report at ``output`` that this one has none of: beside
    this report they would pass for this run's."""
    from .diagnosis_csv import CONSISTENCY_PARTS, sibling_path

    for part in ("sublayers", *CONSISTENCY_PARTS):
        path = sibling_path(output, part)
        if path not in written and os.path.isfile(path):
            os.remove(path)


def _failed_file(exc: OSError, stage: str | None, output: str) -> str:
    """The report file a write failed on, by the name the user gave (not the staged one)."""
    name = exc.filename2 or exc.filename
    if not isinstance(name, str) or stage is None:
        return output
    if os.path.dirname(os.path.abspath(name)) == stage:
        return os.path.join(os.path.dirname(output), os.path.basename(name))
    return name if os.path.basename(name) != os.path.basename(stage) else output


def _why(exc: OSError, folder: str) -> str:
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if folder and not os.path.isdir(folder):
        return f"{folder} is a file, not a folder"
    return str(exc.strerror or exc)
