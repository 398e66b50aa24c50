"""srdd-dump: run an unmodified PyTorch program and dump per-layer hidden states to HDF5."""

from __future__ import annotations

import shlex
import sys
from typing import Optional

import typer

from srdd_dump.capture.config import DumpConfig
from srdd_dump.capture.diskspace import MIN_FREE_GB, MIN_FREE_GB_ENV
from srdd_dump.capture.launch import run_exec
from srdd_dump.capture.option_names import named_as_flags
from srdd_dump.cli.usage import run
from srdd_dump.errors import UserError
from srdd_dump.version import __version__

D = DumpConfig()  # the defaults, defined once

app = typer.Typer(add_completion=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]})


def _version(value: bool) -> None:
    if value:
        typer.echo(f"srdd-dump {__version__}")
        raise typer.Exit()


@app.command()
def dump(
    exec_: list[str] = typer.Option(..., "--exec", metavar="<str>",
                                    help='Command to run, e.g. "python infer.py". Split like '
                                    "a shell would, but never run through a shell."),
    output: str = typer.Option(D.dump_path, "-o", "--output",
                               help="Folder for the dumps: each run writes into its own new "
                               "folder srdd_dump_<UTC time> in it."),
    samples: int = typer.Option(D.samples, "--samples",
                                help="Prefill forwards (samples) to capture."),
    steps: str = typer.Option(D.steps, "--steps", help="Forward rounds per sample, msit -er style: "
                              "0 = prefill, 0,1-4 = prefill + decode steps 1..4, all."),
    tokens: str = typer.Option(D.tokens, "--tokens", help="Token positions kept: all, 0:16, -8:, "
                               "0,5,-1."),
    layers: Optional[str] = typer.Option(
        None, "--layers",
        help="Glob over module names naming the blocks, overriding discovery "
        "(e.g. 'model.layers.*').",
    ),
    seed: int = typer.Option(D.seed, "--seed", help="Seed of srdd-dump's own random choices."),
    probes: str = typer.Option(D.probes, "--probes", help="Layer-local probes: any of "
                               "gain,dc,repeat,scale,causal,attention,mlp,norm, or none."),
    probe_steps: str = typer.Option(D.probe_steps, "--probe-steps", help="Which captured "
                                    "steps are probed too (--steps syntax, or all; 0: the "
                                    "prefill only)."),
    probe_samples: int = typer.Option(D.probe_samples, "--probe-samples", help="Probe each "
                                      "probed step in the first N samples that reach it; the "
                                      "others are captured without probes."),
    sigma: list[float] = typer.Option(D.sigmas, "--sigma", help="Gain probe noise size "
                                      "relative to each token's std (repeatable)."),
    draws: int = typer.Option(D.draws, "--draws", help="Gain noise draws per sigma."),
    dc: list[float] = typer.Option(D.dc, "--dc", help="DC probe shift in token stds "
                                   "(repeatable)."),
    repeats: int = typer.Option(D.repeats, "--repeats", help="Unperturbed re-runs per layer."),
    granularity: str = typer.Option(D.granularity, "--granularity",
                                    help="block; sublayer: the attention, MLP and the block's "
                                    "norms too; op: every operator inside the blocks too (a "
                                    "hunt)."),
    sublayers: Optional[str] = typer.Option(None, "--sublayers", help="Globs relative to a "
                                            "block naming the sub-layers, e.g. 'self_attn,mlp'."),
    reference: str = typer.Option(D.reference, "--reference", help="none, or host: re-run "
                                  "each probed module in float64 on the host CPU and judge "
                                  "the device against it."),
    store: str = typer.Option(D.store, "--store", help="sample:N (probe outputs on about N "
                              "elements of seeded token rows), full, or stats[:R]: statistics "
                              "reduced on the device instead of tensors, ~1% of the size, "
                              "and R seeded rows (default 2) of each block for --baseline."),
    inject: list[str] = typer.Option([], "--inject", help="Simulated fault, e.g. "
                                     "'dead_zone@layer=10,m=0.3,sparsity=0.1,site=mlp' "
                                     "(repeatable)."),
    tp_replays: str = typer.Option(D.tp_replays, "--tp-replays", help="Tensor parallel: skip "
                                   "(never replay a module with sharded weights: a replay "
                                   "communicates) or lockstep (replay it on every rank at "
                                   "once, agreed through the process group's store)."),
    batch_probes: bool = typer.Option(D.batch_probes, "--batch-probes/--no-batch-probes",
                                      help="Replay perturbed inputs in one batched call."),
    eager: bool = typer.Option(False, "--eager", help="Turn torch.compile off in the command "
                               "(TORCHDYNAMO_DISABLE=1): compiled blocks run eagerly, where "
                               "the hooks see them."),
    min_free_gb: float = typer.Option(MIN_FREE_GB, "--min-free-gb", envvar=MIN_FREE_GB_ENV,
                                      help="Refuse to start when the output folder's file "
                                      "system has less free space (GB); 0 = no check."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks, the "
                               "command's capture errors' too."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Show the version and exit."),
) -> None:
    """Run a command with capture injected into every Python process it starts.

    Exit code: the command's own if non-zero; 3 if capture failed; 2 for bad options.
    """
    try:
        if len(exec_) > 1:  # the last would run, the others silently not
            raise UserError(f"--exec is given {len(exec_)} times: one command per run (a "
                            "shell script or `sh -c '...'` runs several)")
        with named_as_flags():  # an error names the flag, not the DumpConfig field
            config = DumpConfig(
                dump_path=output, samples=samples, steps=steps, tokens=tokens, layers=layers,
                seed=seed, probes=probes, probe_steps=probe_steps,
                probe_samples=probe_samples, sigmas=list(sigma), draws=draws, dc=list(dc),
                repeats=repeats, granularity=granularity, sublayers=sublayers, store=store,
                reference=reference,
                inject=list(inject), batch_probes=batch_probes, tp_replays=tp_replays,
                progress=not quiet, debug=debug,
            )
        result = run_exec(exec_[0], config, min_free_gb=min_free_gb, eager=eager)
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
    for folder, files in result.folders().items():
        what = "run folder" if folder == result.run_dir else "the program's own folder"
        typer.echo(f"srdd-dump: {what} {folder} ({len(files)} file"
                   f"{'s' if len(files) > 1 else ''}); compare it with: "
                   f"srdd-compare {shlex.quote(str(folder))}", err=True)
    requests = result.requests_line(samples)
    if requests:
        typer.echo(f"srdd-dump: {requests}", err=True)
    for note in result.untested_versions:
        typer.echo(f"srdd-dump: note: {note}", err=True)
    for line in result.degraded:
        typer.echo(f"srdd-dump: warning: evidence missing: {line}", err=True)
    for problem in result.refused + result.problems:
        typer.echo(f"srdd-dump: error: {problem}", err=True)
    ended = result.describe_exit()
    if ended:
        typer.echo(f"srdd-dump: {ended}", err=True)
    raise typer.Exit(result.exit_code)


# msit llm dump's flags srdd-dump has no option of, and what does their job
_STEPS = "use --steps (the forward rounds kept: 0 the prefill, 1-3 decode steps 1 to 3)"
_LAYERS = "use --layers (a glob of block names, e.g. 'model.layers.1[0-2]') or --granularity"
MSIT_FLAGS = {
    "-er": _STEPS, "--execute-range": _STEPS, "--token-range": _STEPS,
    "-tid": _LAYERS, "--tensor-ids": _LAYERS, "--module-list": _LAYERS,
    "-type": "use --store (sample:N, full or stats) and --granularity (block, sublayer, op)",
    "--type": "use --store (sample:N, full or stats) and --granularity (block, sublayer, op)",
    "-device": "the device is the program's own: srdd-dump captures where the model runs",
    "--device": "the device is the program's own: srdd-dump captures where the model runs",
    # msprobe's config.json keys, tried as flags
    "--task": "use --store: stats for msprobe's task statistics, full or sample:N for tensor",
    "--level": "use --granularity: block (msprobe's L0 of the decoder layers), sublayer, op",
    "--list": _LAYERS, "--scope": _LAYERS,
    "--step": "use --steps (the forward rounds kept: 0 the prefill, 1-3 decode steps 1 to 3)",
    "--rank": "every process (rank) writes its own file, srdd_rank<R>_pid<P>.h5",
    "--dump-path": "use -o (the folder the run's dump goes to)",
    "--dump_path": "use -o (the folder the run's dump goes to)",
}


def main() -> int:
    return run(app, "srdd-dump", msit=MSIT_FLAGS,
               other=("srdd_dump.cli.compare", "srdd-compare", "it compares the dumps"))


if __name__ == "__main__":
    sys.exit(main())
