"""srdd-compare: read the dump files of a run and write the per-layer report. No logic here."""

from __future__ import annotations

import sys
import traceback
from typing import Optional

import typer

from srdd_dump.analysis.tolerance import Thresholds
from srdd_dump.errors import UserError, first_line
from srdd_dump.gating import fail_levels
from srdd_dump.version import __version__
from srdd_dump.watchdog import arm, supervise

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
        "With --baseline GOLDEN, DUMPS (e.g. from an NPU) are compared with the golden dumps "
        "layer by layer instead: msit llm compare's columns plus SQNR, msprobe's error ratios, "
        "error growth, a dtype-aware PASS/WARN/FAIL verdict and the first divergent layer; "
        ".xlsx adds a summary sheet with a chart.\n\n"
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
    aqn_config: Optional[str] = typer.Option(None, "--aqn-config", help="Also write per-layer "
                                             "AQN training-noise scales (YAML) from the "
                                             "diagnosis."),
    fail_on: Optional[str] = typer.Option(None, "--fail-on", help="Exit 1 when a layer is "
                                          "judged 'fault' (or 'suspect' or worse): CI gating."),
    baseline: Optional[str] = typer.Option(
        None, "--baseline", help="Golden dumps (e.g. from a GPU): compare DUMPS with them layer "
        "by layer (msit metrics, PASS/WARN/FAIL, first divergent layer)."),
    jobs: int = typer.Option(1, "--jobs", "-j", help="Processes that share the work (e.g. 2 "
                             "on a 2-core machine); with and without --baseline."),
    tolerance: str = typer.Option(
        "auto", "--tolerance", help="--baseline: dtype whose default limits judge the rows: "
        "auto (the less precise side), float32, float16 or bfloat16."),
    cos_warn: Optional[float] = typer.Option(
        None, "--cos-warn", help="--baseline: WARN when cosine similarity is below this."),
    cos_fail: Optional[float] = typer.Option(
        None, "--cos-fail", help="--baseline: FAIL when cosine similarity is below this "
        "[0.99]."),
    rel_dist_warn: Optional[float] = typer.Option(
        None, "--rel-dist-warn", help="--baseline: WARN when relative_euclidean_distance is "
        "above this [dtype default]."),
    rel_dist_fail: Optional[float] = typer.Option(
        None, "--rel-dist-fail", help="--baseline: FAIL when relative_euclidean_distance is "
        "above this [dtype default]."),
    max_abs_warn: Optional[float] = typer.Option(
        None, "--max-abs-warn", help="--baseline: WARN when max_absolute_error is above this."),
    max_abs_fail: Optional[float] = typer.Option(
        None, "--max-abs-fail", help="--baseline: FAIL when max_absolute_error is above this "
        "(msprobe: 0.001)."),
    read_timeout: float = typer.Option(
        300.0, "--read-timeout", help="Fail with exit code 2 when one read of a dump file "
        "takes longer than this many seconds (a damaged file can hang the HDF5 library); "
        "0 = no limit."),
    debug: bool = typer.Option(False, "--debug", help="Full traceback on unexpected errors."),
    version: Optional[bool] = typer.Option(
        None, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    arm(read_timeout)
    try:
        from srdd_dump.compare import compare_path
        from srdd_dump.report.terminal import summary

        gate = fail_levels(fail_on)
        thresholds = Thresholds(tolerance, rel_dist_warn, rel_dist_fail, cos_warn, cos_fail,
                                max_abs_warn, max_abs_fail)
        if baseline is not None:
            if explain or aqn_config:
                raise UserError("--explain and --aqn-config apply without --baseline only")
            _compare_baseline(dumps, baseline, output, thresholds, jobs, quiet, gate)
            return
        if thresholds != Thresholds():
            raise UserError("--tolerance and the threshold options apply with --baseline only")
        result = compare_path(dumps, output, progress=False if quiet else None, jobs=jobs)
        for reason in result.skipped_reasons:
            typer.echo(f"{PROG}: warning: skipped {reason}", err=True)
        if aqn_config:
            from srdd_dump.report.aqn_file import write_aqn

            write_aqn(result.layers, aqn_config)
            result.written.append(aqn_config)
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
        _fail(f"unexpected {type(exc).__name__}: {first_line(exc)}{hint}")


def _compare_baseline(dumps, baseline, output, thresholds, jobs, quiet, gate) -> None:
    from srdd_dump.baseline import compare_baseline
    from srdd_dump.report.baseline_report import summary_text

    result = compare_baseline(dumps, baseline, output, thresholds, jobs,
                              progress=False if quiet else None)
    for reason in result.skipped_reasons:
        typer.echo(f"{PROG}: warning: skipped {reason}", err=True)
    if not quiet:
        typer.echo(summary_text(result))
    if result.worst_verdict() in gate:
        raise typer.Exit(code=1)



def main() -> None:
    # The command runs in a child process, so a read that hangs inside HDF5 ends in one line.
    sys.exit(supervise(lambda: app(prog_name=PROG), PROG))


if __name__ == "__main__":
    main()
