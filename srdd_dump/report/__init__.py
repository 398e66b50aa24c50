"""Render compare results: CSV, XLSX or terminal text. One dispatch on the report's extension
(``write_report``); the writers import openpyxl only for XLSX (0.16 s of a CSV compare)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..errors import UserError
from .placing import existing_part

if TYPE_CHECKING:  # the result modules: not before a compare has run
    from ..compare.results import BaselineResult, CompareResult

REPORT_FORMATS = (".csv", ".xlsx")


def report_format(output: str) -> str:
    """The report format of a path: ".csv" or ".xlsx"; UserError for anything else."""
    ext = os.path.splitext(output)[1].lower()
    if not output.strip():
        raise UserError("-o is empty: name the report file (report.csv or report.xlsx)")
    if os.path.isdir(output) or output.endswith(("/", os.sep)):  # msit's -o is a folder
        raise UserError(f"{output}: a folder; -o names the report file (report.csv or "
                        "report.xlsx)")
    if ext not in REPORT_FORMATS:
        raise UserError(
            f"{output}: unknown report format {ext or '(no extension)'!r}; use .csv or .xlsx"
        )
    where = existing_part(os.path.dirname(os.path.abspath(output)))
    if where and not os.path.isdir(where):  # said before the work, not after it
        raise UserError(f"{output}: cannot write the report ({where} is a file, not a folder)")
    return ext


def report_files(output: str) -> list[str]:
    """Every file a report at ``output`` may write (the main report first)."""
    from .diagnosis_csv import files_csv_path

    if report_format(output) != ".csv":
        return [output]
    return [output, files_csv_path(output), *_optional_tables(output)]


def _optional_tables(output: str) -> tuple[str, ...]:
    """The CSV tables a report has only when its result holds them (an earlier report's are
    removed when this one has none)."""
    from .diagnosis_csv import CONSISTENCY_PARTS, sibling_path

    return tuple(sibling_path(output, part) for part in ("sublayers", *CONSISTENCY_PARTS))


def write_report(result: CompareResult | BaselineResult, output: str) -> list[str]:
    """Write ``result`` in the format of ``output``'s extension, whole (report/placing.py);
    returns the files written (the main report first)."""
    from .placing import place

    ext = report_format(output)
    stale = _optional_tables(output) if ext == ".csv" else ()
    return place(output, lambda path: _write(result, path, ext), stale)


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
