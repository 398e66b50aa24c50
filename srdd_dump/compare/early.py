"""The reference-free compare's worker processes started first, before the imports and the
inspection of the files (``start_workers``): the CLI calls it as soon as its options are
parsed, and ``api.compare_path`` takes the workers (``pipeline.prestart``). Imports no pandas.
"""

from __future__ import annotations

from .pipeline import default_jobs, prestart
from .signal_reader import run_task
from .sources import locate

SIGNAL_TASKS = run_task.__module__  # the module a reference-free worker runs tasks of


def start_workers(path: str, jobs: int | None = None, run: str | None = None) -> None:
    """Start the worker processes ``compare_path(path, jobs=jobs, run=run)`` will use, now.
    Nothing happens on any error (the compare itself reports it) or for an msprobe dump not
    yet converted."""
    try:
        paths, _, _ = locate(path, run=run, convert=False)
        if paths:
            prestart(default_jobs(paths) if jobs is None else jobs, SIGNAL_TASKS)
    except Exception:  # noqa: BLE001 (the compare reports it)
        pass
