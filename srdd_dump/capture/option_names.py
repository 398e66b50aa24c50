"""How an error names a capture option: as the user gave it. ``srdd-dump --samples 0`` is told
about ``--samples``, ``DumpConfig(samples=0)`` about ``DumpConfig samples`` (an in-code user
has no flags to look up). No torch here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

# DumpConfig fields whose srdd-dump flag is not the field's name with dashes
FLAGS = {"dump_path": "-o", "sigmas": "--sigma", "batch_probes": "--batch-probes"}

_command_line: ContextVar[bool] = ContextVar("srdd_dump_command_line", default=False)


@contextmanager
def named_as_flags(on: bool = True) -> Iterator[None]:
    """Within: errors name srdd-dump's flags (the options came from its command line)."""
    token = _command_line.set(on or _command_line.get())
    try:
        yield
    finally:
        _command_line.reset(token)


def option(field: str) -> str:
    """``"probe_steps"`` -> ``"--probe-steps"`` on the command line, else
    ``"DumpConfig probe_steps"``."""
    if _command_line.get():
        return FLAGS.get(field, "--" + field.replace("_", "-"))
    return f"DumpConfig {field}"
