"""srdd-compare: read the dump files of a run and write the per-layer report. No logic here."""

from __future__ import annotations

import sys
import traceback
from typing import Optional

import typer

from srdd_dump.analysis.tolerance import AUTO, MSPROBE_COSINE, InvalidThresholds, Thresholds
from srdd_dump.cli.usage import run
from srdd_dump.errors import UserError, first_line
from srdd_dump.runtime.memory import fewer_collections, keep_freed_memory
from srdd_dump.runtime.watchdog import arm, leave, supervise
from srdd_dump.version import __version__

PROG = "srdd-compare"
DEFAULT_OUTPUT = "srdd_report.csv"

app = typer.Typer(
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"{PROG} {__version__}")
        raise typer.Exit()


def _say(text: str, err: bool = False) -> None:
    from srdd_dump.report.escape import for_terminal

    typer.echo(for_terminal(text), err=err)


def _fail(message: str) -> None:
    _say(f"{PROG}: error: {message}", err=True)
    raise typer.Exit(code=2)


@app.command(
    help=(
        "Compare the dump files under DUMPS (a folder searched recursively for *.h5 and "
        "crashed *.h5.partial files, or one file) and write a report, most suspicious "
        "layers first.\n\n"
        "Without --baseline (reference-free): each block layer gets a verdict, FAULT, "
        "SUSPECT or NORMAL, from exact evidence (repeat runs that differ, exact zeros, "
        "clipped or stuck values, NaN/Inf, lost fp32 precision) and from a bias relative "
        "to the other layers; docs/method.md has the rules. With 3 or more cards that ran "
        "the same inputs, the odd card out is named too.\n\n"
        "With --baseline GOLDEN: DUMPS (e.g. from an NPU) are compared with the golden "
        "dumps layer by layer: msit llm compare's columns, SQNR, msprobe's error ratios, "
        "error growth, a dtype-aware PASS/WARN/FAIL and the first divergent layer.\n\n"
        "The format follows the extension of --output. .csv: the main table there, the "
        "file table as <stem>.files.csv, sub-layers as <stem>.sublayers.csv, consistency as "
        "<stem>.consistency*.csv. .xlsx: one workbook (summary, layers, signals with charts, "
        "sublayers, files, consistency, consistency_summary; baseline: compare, summary "
        "with a chart, files).\n\n"
        "Exit code: 0 report written; 1 --fail-on level reached; 2 bad input, no "
        "usable file, or (--baseline) not one row of the two dumps compared (report "
        "written)."
    ),
    no_args_is_help=False,
)
def compare(
    dumps: str = typer.Argument(..., metavar="DUMPS", help="Dump folder or dump file."),
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
    jobs: Optional[int] = typer.Option(
        None, "--jobs", "-j", help="Processes that share the work [default: one, plus one per "
        "256 MB of dump, up to the cores this process may use]; -j 1: this process only."),
    run: Optional[str] = typer.Option(
        None, "--run", help="DUMPS holds several runs (srdd-dump writes each into its own "
        "srdd_dump_<time> folder): compare this one (its folder name) instead of the newest; "
        "'all' compares every run together."),
    baseline_run: Optional[str] = typer.Option(
        None, "--baseline-run", help="The same for the --baseline folder."),
    mapping: Optional[str] = typer.Option(
        None, "--mapping", help="--baseline: YAML file of 'my site: golden site(s)' lines for "
        "sub-layers and operators named differently on the two sides (docs/cli.md)."),
    tolerance: str = typer.Option(
        AUTO, "--tolerance", help="--baseline: dtype whose default limits judge the rows: "
        "auto (the less precise side), float32, float16 or bfloat16."),
    cos_warn: Optional[float] = typer.Option(
        None, "--cos-warn", help="--baseline: WARN when cosine similarity is below this."),
    cos_fail: Optional[float] = typer.Option(
        None, "--cos-fail", help="--baseline: FAIL when cosine similarity is below this "
        f"(default {MSPROBE_COSINE})."),
    rel_dist_warn: Optional[float] = typer.Option(
        None, "--rel-dist-warn", help="--baseline: WARN when relative_euclidean_distance is "
        "above this (default: by dtype, docs/method.md)."),
    rel_dist_fail: Optional[float] = typer.Option(
        None, "--rel-dist-fail", help="--baseline: FAIL when relative_euclidean_distance is "
        "above this (default: by dtype, docs/method.md)."),
    max_abs_warn: Optional[float] = typer.Option(
        None, "--max-abs-warn", help="--baseline: WARN when max_absolute_error is above this."),
    max_abs_fail: Optional[float] = typer.Option(
        None, "--max-abs-fail", help="--baseline: FAIL when max_absolute_error is above this "
        "(msprobe: 0.001)."),
    metrics: str = typer.Option(
        "msit", "--metrics", help="--baseline: msit (default) or msprobe: max_relative_error "
        "and the thousandth ratios by msprobe's own rules (docs/method.md), to match numbers "
        "in existing msprobe reports."),
    read_timeout: float = typer.Option(
        300.0, "--read-timeout", help="Fail with exit code 2 when one read of a dump file "
        "takes longer than this many seconds (a damaged file can hang the HDF5 library); "
        "0 = no limit."),
    debug: bool = typer.Option(False, "--debug", help="Full traceback on unexpected errors."),
    version: Optional[bool] = typer.Option(
        None, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    try:
        from srdd_dump.runtime.pool import main_is_ours

        main_is_ours()  # the workers need not run this entry point again
        if baseline is None and (jobs is None or jobs > 1):
            # the workers start first: they boot while this process imports and inspects
            from srdd_dump.compare.early import start_workers

            start_workers(dumps, jobs, run)
        # imported here, in the supervised child: --help and --version stay fast
        from srdd_dump import compare as modes
        from srdd_dump.analysis.verdicts import FAIL_ON
        from srdd_dump.format.reader import set_read_monitor
        from srdd_dump.report import report_format, write_report

        if not read_timeout >= 0:
            raise UserError(f"--read-timeout {read_timeout}: must be 0 (no limit) or more "
                            "seconds")
        set_read_monitor(arm(read_timeout))
        gate = _fail_levels(fail_on, FAIL_ON)
        report_format(output)
        if aqn_config:
            from srdd_dump.report.aqn import check_apart

            check_apart(aqn_config, output, (dumps, baseline))
        if jobs is not None and jobs < 1:
            raise UserError(f"--jobs {jobs}: must be at least 1")
        thresholds = Thresholds(
            tolerance=tolerance, rel_dist_warn=rel_dist_warn, rel_dist_fail=rel_dist_fail,
            cos_warn=cos_warn, cos_fail=cos_fail, max_abs_warn=max_abs_warn,
            max_abs_fail=max_abs_fail, metrics=metrics,
        )
        progress = False if quiet else None
        if baseline is not None:
            if explain or aqn_config:
                raise UserError("--explain and --aqn-config apply without --baseline only")
            result = modes.compare_baseline(dumps, baseline, thresholds, jobs=jobs,
                                             progress=progress, run=run,
                                             baseline_run=baseline_run, mapping=mapping)
        else:
            if thresholds != Thresholds() or baseline_run is not None or mapping is not None:
                raise UserError("--tolerance, --metrics, the threshold options, "
                                "--baseline-run and --mapping apply with --baseline only")
            result = modes.compare_path(dumps, jobs=jobs, progress=progress, run=run)
        for note in result.notes:
            _say(f"{PROG}: note: {note}", err=True)
        try:
            written, unwritten = write_report(result, output), None
        except UserError as exc:  # the finding is still shown, then this error
            written, unwritten = [], exc
        for reason in result.skipped_reasons:
            _say(f"{PROG}: warning: skipped {reason}", err=True)
        if aqn_config and unwritten is None:
            from srdd_dump.report.aqn import write_aqn

            written.append(write_aqn(result.layers, aqn_config))
        if not quiet:
            from srdd_dump.report.terminal import baseline_text, diagnosis_text

            if baseline is not None:
                _say(baseline_text(result, written))
            else:
                _say(diagnosis_text(result, written, explain=explain))
        if unwritten is not None:
            raise unwritten
        if baseline is not None and result.nothing_compared:
            hint = ("capture both runs with the same batching (a batch's sequences pair by "
                    "their position in it): run the batched one a prompt at a time (batch 1, "
                    "as a serving engine's dump holds each request apart)"
                    if "batched differently" in result.nothing_compared
                    else "are both dumps of the same model and prompts?")
            raise UserError(f"nothing was compared ({result.nothing_compared}): {hint} "
                            "(report written)")
        if result.worst_verdict() in gate:
            raise typer.Exit(code=1)
    except typer.Exit:
        raise
    except InvalidThresholds as exc:
        _fail(exc.render(lambda name: "--" + name.replace("_", "-")))
    except UserError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        typer.echo(f"{PROG}: interrupted", err=True)
        raise typer.Exit(code=130) from None
    except BrokenPipeError:  # `srdd-compare ... | true`: the report is written, as `yes | true`
        from srdd_dump.runtime.terminal import quiet_stdout

        quiet_stdout()
        raise typer.Exit(code=141) from None
    except Exception as exc:
        if debug:
            traceback.print_exc(file=sys.stderr)
        hint = "" if debug else " (run with --debug for the traceback)"
        _fail(f"unexpected {type(exc).__name__}: {first_line(exc)}{hint}")
    finally:
        from srdd_dump.compare.pipeline import discard_started

        discard_started()  # workers started early that no scan took (a user error)


def _fail_levels(option: str | None, levels: dict) -> tuple[str, ...]:
    if option is None:
        return ()
    if option.strip().lower() not in levels:
        raise UserError(f"--fail-on {option!r}: use {' or '.join(levels)}")
    return levels[option.strip().lower()]


def start_workers_early(argv: list[str]) -> None:
    """Start the reference-free compare's workers from the raw options (click's parser, no
    conversion), before typer converts them: its first conversion imports pydantic's adapters
    (about 80 ms). No file is open yet, so they are forked where that is safe (then they hold
    this process's imports at once). Help, --version, --baseline or options click cannot parse
    leave it to the command."""
    try:
        command = typer.main.get_command(app)
        opts, _, _ = command.make_parser(command.context_class(command)).parse_args(argv)
        if opts.get("baseline") is not None or opts.get("help") or opts.get("version"):
            return
        jobs = None if opts.get("jobs") is None else int(opts["jobs"])
        if opts.get("dumps") is None or (jobs is not None and jobs <= 1):
            return
    except Exception:  # noqa: BLE001 (the command reports bad options)
        return
    from srdd_dump.compare.early import start_workers
    from srdd_dump.runtime.pool import main_is_ours

    main_is_ours()
    start_workers(opts["dumps"], jobs, opts.get("run"), fork=True)


# msit llm compare's flags srdd-compare has no option of, and what does their job
_PATHS = "the dumps are arguments: srdd-compare MY_DUMPS --baseline GOLDEN_DUMPS"
MSIT_FLAGS = {
    "-gp": _PATHS, "--golden-path": _PATHS, "-mp": _PATHS, "--my-path": _PATHS,
    "--golden": _PATHS, "-op": "use --mapping (a YAML file of 'my site: golden site(s)')",
    "--op-mapping-file": "use --mapping (a YAML file of 'my site: golden site(s)')",
    # msprobe's selections, tried as flags: its folders select
    "--step": "give the step's folder as the path (an msprobe dump's DUMP/step1; every step "
              "of a folder of steps is read)",
    "--rank": "give the rank's folder or file as the path (DUMP/step0/rank1); a folder of "
              "ranks pairs each with the golden run's same rank",
}


def run_command() -> int:
    """The command as the watched child runs it (``main``: the watchdog around it); returns
    its exit code."""
    start_workers_early(sys.argv[1:])
    try:
        return run(app, PROG,
                   "to compare with a golden run: srdd-compare MINE --baseline GOLDEN",
                   msit=MSIT_FLAGS,
                   other=("srdd_dump.cli.dump", "srdd-dump", "what a run captures"))
    finally:
        from srdd_dump.runtime.pool import reap

        reap()  # the workers told to end at the scan's end, ended by now


def main() -> None:
    # Process-wide settings belong to the entry point, not to a library call.
    keep_freed_memory()
    fewer_collections()
    # The command runs in a child process, so a read that hangs inside HDF5 ends in one line.
    leave(supervise(run_command, PROG))


if __name__ == "__main__":
    main()
