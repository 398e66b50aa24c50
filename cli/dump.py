"""srdd-dump: run an unmodified PyTorch program and dump per-layer hidden states to HDF5."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from srdd_dump.config import DumpConfig
from srdd_dump.errors import UserError
from srdd_dump.launch import run_exec
from srdd_dump.version import __version__

app = typer.Typer(add_completion=False, context_settings={"help_option_names": ["-h", "--help"]})


def _version(value: bool) -> None:
    if value:
        typer.echo(f"srdd-dump {__version__}")
        raise typer.Exit()


@app.command()
def dump(
    exec_: str = typer.Option(..., "--exec", help='Command to run, e.g. "python infer.py". '
                              "Split like a shell would, but never run through a shell."),
    output: str = typer.Option("srdd_dumps", "-o", "--output", help="Folder for the dump files."),
    samples: int = typer.Option(8, "--samples", help="Prefill forwards (samples) to capture."),
    steps: str = typer.Option("0", "--steps", help="Forward rounds per sample, msit -er style: "
                              "0 = prefill, 0,1-4 = prefill + decode steps 1..4, all."),
    tokens: str = typer.Option("all", "--tokens", help="Token positions kept: all, 0:16, -8:, "
                               "0,5,-1."),
    layers: Optional[str] = typer.Option(
        None, "--layers",
        help="Glob over module names naming the blocks, overriding discovery "
        "(e.g. 'model.layers.*').",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of srdd-dump's own random choices."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True),
) -> None:
    """Run a command with capture injected into every Python process it starts.

    Exit code: the command's own if non-zero; 3 if capture failed; 2 for bad options.
    """
    try:
        config = DumpConfig(
            dump_path=output, samples=samples, steps=steps, tokens=tokens, layers=layers, seed=seed
        )
        result = run_exec(exec_, config)
    except UserError as exc:
        typer.echo(f"srdd-dump: error: {exc}", err=True)
        raise typer.Exit(2) from None
    except Exception as exc:
        if debug:
            raise
        typer.echo(f"srdd-dump: error: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(2) from None
    for path in result.files:
        typer.echo(f"srdd-dump: wrote {path}", err=True)
    for problem in result.problems:
        typer.echo(f"srdd-dump: error: {problem}", err=True)
    if result.returncode != 0:
        typer.echo(f"srdd-dump: the command exited with code {result.returncode}", err=True)
    raise typer.Exit(result.exit_code)


def main() -> None:
    app(prog_name="srdd-dump")


if __name__ == "__main__":
    sys.exit(main())
