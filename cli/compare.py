"""srdd-compare: read the dump files of a run and write the per-layer report. No logic here."""

from __future__ import annotations

import sys
import traceback
from typing import Optional

import typer

from srdd_dump.errors import UserError
from srdd_dump.gating import fail_levels
from srdd_dump.version import __version__

PROG = "srdd-compare"
DEFAULT_OUTPUT = "srdd_report.csv"

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"{PROG} {__version__}")
        raise typer.Exit()


def _fail(message: str) -> None:
    typer.echo(f"{PROG}: error: {message}", err=True)
    raise typer.Exit(code=2)


@app.command(
    help=(
        "Compare the dump files under DUMPS (a folder searched recursively for *.h5 and "
        "crashed *.h5.partial files, or one file) and write a per-layer report, most "
        "suspicious layers first (FAULT: NaN/Inf or all zero; SUSPECT: mostly zeros).\n\n"
        "The report format follows the extension of --output: .csv writes the layer table "
        "there and the file table next to it as <stem>.files.csv; .xlsx writes one workbook "
        "with the sheets 'layers' and 'files'. Unreadable files are skipped and listed.\n\n"
        "Exit code: 0 when a report was written, 2 on bad input or when no file is usable."
    ),
    no_args_is_help=False,
)
def compare(
    dumps: str = typer.Argument(..., help="Dump folder or dump file."),
    output: str = typer.Option(
        DEFAULT_OUTPUT,
        "--output",
        "-o",
        help="Report file, .csv or .xlsx; the default is in the current folder.",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary, no progress bars."),
    explain: bool = typer.Option(False, "--explain", help="Print the evidence behind every "
                                 "FAULT and SUSPECT verdict."),
    fail_on: Optional[str] = typer.Option(None, "--fail-on", help="Exit 1 when a layer is "
                                          "judged 'fault' (or 'suspect' or worse): CI gating."),
    debug: bool = typer.Option(False, "--debug", help="Full traceback on unexpected errors."),
    version: Optional[bool] = typer.Option(
        None, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    try:
        from srdd_dump.compare import compare_path
        from srdd_dump.report.terminal import summary

        gate = fail_levels(fail_on)
        result = compare_path(dumps, output, progress=False if quiet else None)
        for reason in result.skipped_reasons:
            typer.echo(f"{PROG}: warning: skipped {reason}", err=True)
        if not quiet:
            typer.echo(summary(result, explain=explain))
        if result.worst_verdict() in gate:
            raise typer.Exit(code=1)
    except typer.Exit:
        raise
    except UserError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        typer.echo(f"{PROG}: interrupted", err=True)
        raise typer.Exit(code=130) from None
    except Exception as exc:
        if debug:
            traceback.print_exc(file=sys.stderr)
        hint = "" if debug else " (run with --debug for the traceback)"
        _fail(f"unexpected {type(exc).__name__}: {_first_line(exc)}{hint}")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def main() -> None:
    app(prog_name=PROG)


if __name__ == "__main__":
    main()
