"""The commands' usage errors (an option's bad value, an unknown option, a missing argument) as
one line, like every other error of theirs: ``PROG: error: ...`` and exit code 2, without
click's usage block."""

from __future__ import annotations

import re
import sys

import typer

# click's UsageError, whether typer vendors click (0.29) or imports it (older releases)
USAGE_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def run(app: typer.Typer, prog: str, extra_hint: str = "",
        msit: dict[str, str] | None = None,
        other: tuple[str, str, str] | None = None) -> int:
    """Run ``app`` on the command line; returns its exit code. ``extra_hint``: said after an
    error of arguments given beyond the command's (what the user may have meant); ``msit``:
    msit's flags this command has no option of, and what does their job here; ``other``:
    (module, name, what it does) of the other command, whose options given here are said to
    be its."""
    # before click reads them: it takes -er for -e and -op for -o p (a report named "p")
    flag = _msit_flag(msit or {})
    if flag is not None:
        typer.echo(f"{prog}: error: No such option: {flag}; {msit[flag]} (see {prog} --help)",
                   err=True)
        return 2
    try:
        code = app(prog_name=prog, standalone_mode=False)
    except USAGE_ERROR as exc:
        message = exc.format_message()
        hint = f"; {extra_hint}" if extra_hint and "unexpected extra argument" in message \
            else _other_tools(exc, app, other)
        if hint.startswith("; --"):  # the other command's option: click's guesses here mislead
            message = re.sub(r" \(Possible options: [^)]*\)| Did you mean [^?]*\?", "",
                             message)
        typer.echo(f"{prog}: error: {message}{hint} (see {prog} --help)", err=True)
        return exc.exit_code
    except typer.Abort:  # Ctrl-C before the command's own handler (while options are read)
        typer.echo(f"{prog}: interrupted", err=True)
        return 130
    return code if isinstance(code, int) else 0


def _msit_flag(msit: dict[str, str]) -> str | None:
    """The first of msit's flags on the command line (``-er 0,1``, ``--golden-path=x``), up
    to a ``--`` (what follows is no option)."""
    for arg in sys.argv[1:]:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if name in msit:
            return name
    return None


def _other_tools(exc: Exception, app: typer.Typer, other: tuple[str, str, str] | None) -> str:
    """"; --steps is an option of srdd-dump (...)" when the option this command has not is
    the other command's (an option both have, given a bad value, is this one's)."""
    flag = getattr(exc, "option_name", None)
    if not flag or other is None or type(exc).__name__ != "NoSuchOption":
        return ""
    module, name, what = other
    try:
        import importlib

        def options(of: typer.Typer) -> set[str]:
            command = typer.main.get_command(of)
            return {o for p in command.params for o in (*p.opts, *p.secondary_opts)}

        theirs = options(importlib.import_module(module).app)
        if flag not in theirs or flag in options(app):
            return ""
    except Exception:  # noqa: BLE001 (the error is said without the hint)
        return ""
    return f"; {flag} is an option of {name} ({what})"
