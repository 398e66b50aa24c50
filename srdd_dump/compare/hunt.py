"""The capture that names the operator inside a faulty layer: when the default scan finds a
FAULT at a block or sub-layer and the dump holds no operators (``--granularity`` block or
sublayer), the exact srdd-dump command that re-runs the user's program with that one layer's
operators and their float64 host replays (``--granularity op --reference host --layers
BLOCK``), from the folder the run's command ran in: the hunt costs one layer, not the model.
A simulated fault (``--inject``) goes along when it is in that layer."""

from __future__ import annotations

import os
import shlex

from ..format.layer_numbers import layer_numbers, position_of
from ..vocabulary import BLOCK, LINEAR, SUBLAYER
from .sources import DumpFile

HUNTED = ("op",)  # granularities that already hold the operators
# the options of the run that decide what the hunt sees again: the same rounds and store
KEPT = (("samples", "--samples"), ("steps", "--steps"), ("tokens", "--tokens"),
        ("seed", "--seed"), ("store", "--store"), ("probe_steps", "--probe-steps"),
        ("probe_samples", "--probe-samples"), ("sublayers", "--sublayers"),
        ("tp_replays", "--tp-replays"))


# what the hunt of an msprobe dump runs: the user's program, which the dump does not record
MSPROBE_PROGRAM = "python <the script msprobe dumped>"


def hunt_command(f: DumpFile, layer: int, site: str) -> str | None:
    """The srdd-dump command for the operators of block ``layer`` (the FAULT row's block and
    the module its evidence names), or None when the dump has them already, names an operator,
    or does not say how it was made (an msprobe dump's names its program as a placeholder)."""
    options = f.capture_options
    # the command srdd-dump --exec ran (an in-code register_hook run records no command: its
    # hunt is the DumpConfig to capture with)
    command = options.get("command") if options else None
    if not 0 <= layer < len(f.layers):
        return None
    role = f.site_roles[f.sites.index(site)] if site in f.sites and \
        f.sites.index(site) < len(f.site_roles) else BLOCK
    if role not in (BLOCK, SUBLAYER):
        return None
    if not options and f.origin:
        if any(f.site_layers.get(i) == layer and r == LINEAR for i, r in enumerate(f.site_roles)):
            return None  # its operators are in the dump already (msprobe's level mix or L1)
        # an msprobe dump: its program, run once under srdd-dump for that layer's operators
        return shlex.join(["srdd-dump", "--exec", MSPROBE_PROGRAM, "-o", "dumps_hunt",
                           "--granularity", "op", "--reference", "host",
                           "--layers", f.layers[layer]])
    if not options or options.get("granularity") in HUNTED:
        return None
    numbers = layer_numbers(f.layers)
    injected = [kept for spec in options.get("inject") or [] if (kept := _in_layer(
        str(spec), numbers, layer, layer_numbers(f.layers[layer:layer + 1])[0])) is not None]
    if not command:
        return _in_code(options, injected, f.layers[layer])
    words = ["srdd-dump", "--exec", str(command), "-o", _root(options.get("dump_path"))]
    for key, flag in KEPT:
        value = _kept(options, key)
        if value is not None and value != "":
            words += [flag, str(value)]
    for spec in injected:
        words += ["--inject", spec]
    words += ["--granularity", "op", "--reference", "host", "--layers", f.layers[layer]]
    folder = options.get("command_dir")  # the command may name files relative to it
    return f"cd {shlex.quote(str(folder))} && {shlex.join(words)}" if folder else \
        shlex.join(words)


def _kept(options: dict, key: str):
    """The run's value of a kept option; --probe-samples 0 becomes 1: the hunt's host replays
    run on the probed samples."""
    value = options.get(key)
    return 1 if key == "probe_samples" and value == 0 else value


def _in_code(options: dict, injected: list[str], block: str) -> str:
    """The hunt of a dump made in code: the register_hook call whose DumpConfig captures that
    block's operators, with the options of the run that decide what it sees."""
    # a folder of its own: in code dump_path is the run's folder, which the hunt's file
    # would join as another card of the same run
    fields = {"dump_path": os.path.normpath(str(options.get("dump_path") or "dumps")) + "_hunt"}
    fields.update((key, _kept(options, key)) for key, _ in KEPT
                  if options.get(key) is not None and options.get(key) != "")
    if injected:
        fields["inject"] = injected
    fields.update(granularity="op", reference="host", layers=block)
    return ("register_hook(model, DumpConfig("
            + ", ".join(f"{key}={value!r}" for key, value in fields.items()) + "))")


def _in_layer(spec: str, numbers: list[int], layer: int, hunted: int) -> str | None:
    """A simulated fault (``--inject TYPE@layer=K,...``, K the model's layer number or a
    negative position) of the block at position ``layer``, renumbered as the hunt's one block
    is numbered (``hunted``); None for a fault of another layer, which the hunt's one block
    cannot hold."""
    kind, _, rest = spec.partition("@")
    items = rest.split(",") if rest else []
    for i, item in enumerate(items):
        key, _, value = item.partition("=")
        if key.strip() == "layer":
            try:
                at = int(value)
            except ValueError:
                return None
            if position_of(numbers, at) != layer:
                return None
            items[i] = f"layer={hunted}"
            return f"{kind}@{','.join(items)}"
    return None


def _root(dump_path: str | None) -> str:
    """The -o folder of the run: the parent of its srdd_dump_<time> folder."""
    if not dump_path:
        return "dumps"
    path = os.path.normpath(str(dump_path))
    head, tail = os.path.split(path)
    return (head or ".") if tail.startswith("srdd_dump_") else path
