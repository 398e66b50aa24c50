"""``--fail-on``: which verdicts make srdd-compare exit 1 (for CI gating)."""

from __future__ import annotations

from .errors import UserError

LEVELS = {"fault": ("FAULT",), "suspect": ("FAULT", "SUSPECT")}


def fail_levels(option: str | None) -> tuple[str, ...]:
    if option is None:
        return ()
    key = option.strip().lower()
    if key not in LEVELS:
        raise UserError(f"--fail-on {option!r}: use fault or suspect")
    return LEVELS[key]
