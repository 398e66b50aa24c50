"""Which evidence a capture asked for and which it got: a probe family that ran on none (or on
too few) of the calls where it should have run is reported, never lost silently.

A *family* is one kind of evidence in one phase, e.g. ``"decode block probes"``. The session
calls :meth:`Coverage.expect` where the options ask for it, then :meth:`Coverage.ran` or
:meth:`Coverage.failed` (the first failure's text is kept). :meth:`Coverage.shortfalls` turns
the families under :data:`MIN_FRACTION` into one line each, written by ``srdd-dump`` at the end
and stored in the dump's status (``coverage``) for ``srdd-compare``. Torch-free.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import first_line

# a family that ran on less than this share of the calls where it should have run is reported
MIN_FRACTION = 0.5


@dataclass
class Family:
    expected: int = 0
    done: int = 0
    first_error: str | None = None
    failures: int = 0  # (not stored) the failures counted, and the latest one's cause
    last_error: str | None = None

    def as_dict(self) -> dict:
        return {"expected": self.expected, "done": self.done, "first_error": self.first_error}


class Coverage:
    """Counts per evidence family (see the module docstring)."""

    def __init__(self) -> None:
        self.families: dict[str, Family] = {}

    def expect(self, family: str, n: int = 1) -> None:
        self.families.setdefault(family, Family()).expected += n

    def ran(self, family: str) -> None:
        self.families.setdefault(family, Family()).done += 1

    def failed(self, family: str, why: str) -> None:
        entry = self.families.setdefault(family, Family())
        entry.failures += 1
        entry.last_error = _shortened(first_line(why))
        if entry.first_error is None:
            entry.first_error = entry.last_error

    def retract(self, family: str, why: str) -> None:
        """A call counted as ``ran`` failed after all (its work was finished later)."""
        entry = self.families.setdefault(family, Family())
        entry.done = max(0, entry.done - 1)
        self.failed(family, why)

    @contextlib.contextmanager
    def attempt(self, family: str) -> Iterator[None]:
        """``expect``, then ``ran`` when the block ends, or ``failed`` with its exception
        (re-raised)."""
        self.expect(family)
        try:
            yield
        except Exception as exc:
            self.failed(family, f"{type(exc).__name__}: {exc}")
            raise
        self.ran(family)

    def as_dict(self) -> dict[str, dict]:
        return {name: f.as_dict() for name, f in sorted(self.families.items())}

    def snapshot(self) -> dict[str, dict]:
        """``as_dict`` with each family's failure count: what ``since`` counts from."""
        return {name: {**f.as_dict(), "failures": f.failures}
                for name, f in self.families.items()}

    def since(self, before: dict[str, dict]) -> dict[str, dict]:
        """``as_dict`` of what was counted after ``before`` (an earlier ``snapshot``): the
        counts of a serving engine's later file alone, not of the files finished before it,
        with the cause of a failure since then (the latest), not one an earlier file holds."""
        out = {}
        for name, f in sorted(self.families.items()):
            was = before.get(name)
            if was is None:
                out[name] = f.as_dict()
                continue
            expected, done = f.expected - was["expected"], f.done - was["done"]
            failed_since = f.failures > int(was.get("failures", 0))
            if expected or done:
                out[name] = {"expected": expected, "done": done,
                             "first_error": f.last_error if failed_since else None}
        return out

    def shortfalls(self) -> list[str]:
        return shortfall_lines(self.as_dict())


def summed(coverages: list[dict]) -> dict[str, dict]:
    """The stored coverages of one process's files (each its own counts) as one."""
    out: dict[str, dict] = {}
    for coverage in coverages:
        for name, f in coverage.items():
            entry = out.setdefault(name, {"expected": 0, "done": 0, "first_error": None})
            entry["expected"] += int(f.get("expected") or 0)
            entry["done"] += int(f.get("done") or 0)
            entry["first_error"] = entry["first_error"] or f.get("first_error")
    return out


def shortfall_lines(coverage: dict, min_fraction: float = MIN_FRACTION) -> list[str]:
    """The families (``Coverage.as_dict``, as stored in a dump's status) that ran on fewer than
    ``min_fraction`` of the calls where they should have run: one line per cause, e.g.
    ``decode block probes (0 of 48 calls), decode sub-layer probes (0 of 96 calls): TypeError:
    ...``."""
    by_cause: dict[str, list[str]] = {}
    for name, entry in sorted(coverage.items() if isinstance(coverage, dict) else ()):
        if not isinstance(entry, dict):
            continue
        expected, done = int(entry.get("expected") or 0), int(entry.get("done") or 0)
        if expected <= 0 or done >= min_fraction * expected:
            continue
        cause = str(entry.get("first_error") or "no error was raised")
        by_cause.setdefault(cause, []).append(f"{name} ({done} of {expected} {_unit(name)})")
    return [f"{_what_is_missing(families)}: {', '.join(families)}: {cause}"
            for cause, families in by_cause.items()]


def _what_is_missing(families: list[str]) -> str:
    """"decode steps not probed", "sub-layers not captured"...: what a line's families share."""
    names = [f.split(" (")[0] for f in families]
    if all(n.endswith(" probes") for n in names):
        phases = {n.split()[0] for n in names}
        if phases == {"decode"}:
            return "decode steps not probed"
        return "prefill not probed" if phases == {"prefill"} else "not probed"
    if all(n.endswith(" host replays") for n in names):
        return "no float64 host reference"
    if all(n.endswith(" sites") for n in names):
        return "not captured"
    return "not obtained"


def partial_lines(coverage: dict, min_fraction: float = MIN_FRACTION) -> list[str]:
    """The families that ran on some but not all of their calls, yet on at least
    ``min_fraction`` of them (below it, ``shortfall_lines`` reports them)."""
    lines = []
    for name, entry in sorted(coverage.items() if isinstance(coverage, dict) else ()):
        if not isinstance(entry, dict):
            continue
        expected, done = int(entry.get("expected") or 0), int(entry.get("done") or 0)
        if min_fraction * expected <= done < expected:
            why = f": {entry['first_error']}" if entry.get("first_error") else ""
            lines.append(f"{name} ran on {done} of {expected} {_unit(name)}{why}")
    return lines


def _unit(family: str) -> str:
    return "blocks" if family.endswith(" sites") else "calls"


def _shortened(line: str, limit: int = 200) -> str:
    """At most ``limit`` characters, cut at a space where one is near (never mid-word)."""
    if len(line) <= limit:
        return line
    cut = line[: limit - 3]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip(" ,;:") + "..."
