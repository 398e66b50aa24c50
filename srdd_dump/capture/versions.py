"""The library versions the capture is tested with (``make test`` runs the capture tests on
both ends; pyproject.toml's dev extra states the same range). A program running another
version is told once: the capture still runs, and its coverage (format/coverage.py) reports any
evidence the version made it lose. Torch-free."""

from __future__ import annotations

import re
import sys

# (oldest, newest) tested, inclusive
TESTED = {"transformers": ("4.48.3", "5.24.0"), "torch": ("2.1.0", "2.13.0")}


def version_tuple(version: str) -> tuple[int, ...]:
    """"5.24.0" -> (5, 24, 0); "4.57.0.dev0" -> (4, 57, 0); the leading numbers only."""
    parts = []
    for piece in str(version).split("."):
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.end() < len(piece):
            break
    return tuple(parts)


def untested(name: str, version: str | None) -> str | None:
    """A one-line note when ``version`` of ``name`` is outside the tested range, else None."""
    if name not in TESTED or not version:
        return None
    oldest, newest = TESTED[name]
    v = version_tuple(version)
    if v < version_tuple(oldest):
        where = f"older than the oldest tested ({oldest})"
    elif v > version_tuple(newest):
        where = f"newer than the newest tested ({newest})"
    else:
        return None
    return (f"{name} {version} is {where}: capture runs, and evidence it loses is reported "
            "at the end")


def loaded_version(name: str) -> str | None:
    """The version of an already imported library (never imports it)."""
    module = sys.modules.get(name)
    return getattr(module, "__version__", None) if module is not None else None


def untested_notes() -> list[str]:
    return [note for name in TESTED
            if (note := untested(name, loaded_version(name))) is not None]
