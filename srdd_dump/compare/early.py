"""What the reference-free compare does before it reads a record: its worker processes started
first, before the imports and the inspection of the files (``start_workers``: the CLI calls it
as soon as its options are parsed, and ``api.compare_path`` takes the workers through
``pipeline.prestart``), each already reading its first task (``head_start``), and its tasks
planned (``plan``). Imports no pandas (the reference-free tables need none) and not the
diagnosis (``api.compare_path`` imports it after the scan).
"""

from __future__ import annotations

import functools

from ..vocabulary import NORM
from .pipeline import check_jobs, default_jobs, prestart, workers_started
from .signal_reader import (
    SignalTask,
    chunks,
    expert_sites,
    present_keys,
    run_task,
    with_experts,
)
from .sources import DumpFile, inspected, locate

SIGNAL_TASKS = run_task.__module__  # the module a reference-free worker runs tasks of


def start_workers(path: str, jobs: int | None = None, run: str | None = None,
                  fork: bool = False) -> None:
    """Start the worker processes ``compare_path(path, jobs=jobs, run=run)`` will use, now
    (``fork``: forked where safe, by a process that has opened no file yet), each reading its
    first task (``head_start``) while this process gets ready. Nothing happens on any error
    (the compare itself reports it) or for an msprobe dump not yet converted."""
    if workers_started():  # the command started them from its raw options already
        return
    try:
        paths, _, _ = locate(path, run=run, convert=False)
        if paths:
            jobs = default_jobs(paths) if jobs is None else check_jobs(jobs)
            prestart(jobs, SIGNAL_TASKS, fork=fork,
                     head=functools.partial(head_start, path=path, jobs=jobs, run=run))
    except Exception:  # noqa: BLE001 (the compare reports it)
        pass


def head_start(i: int, path: str, jobs: int, run: str | None
               ) -> tuple[SignalTask | None, list | str | None]:
    """In a worker: task ``i`` of the plan ``compare_path(path, jobs=jobs, run=run)`` makes,
    planned here from the files as they are now, and its result (``run_task``); (None, None)
    when there is none or anything fails (the compare then runs it itself). The worker starts
    reading while the command converts its options and inspects the files (0.1 s on 2 cores),
    at the cost of inspecting the files up to that task's once more (20 ms for one file)."""
    try:
        paths, root, _ = locate(path, run=run, convert=False)
        tasks: list[SignalTask] = []
        for n, f in enumerate(inspected(paths, root)):  # only the files up to task i
            tasks += file_tasks(n, f, jobs)
            if i < len(tasks):
                return tasks[i], run_task(tasks[i])
    except Exception:  # noqa: BLE001 (the compare reports it)
        pass
    return None, None


def plan(files: list[DumpFile], jobs: int) -> list[SignalTask]:
    """The signal tasks of the usable ``files``: runs of consecutive layers (``chunks``) when
    ``jobs`` processes share them, else one task per file."""
    return [task for n, f in enumerate(files) for task in file_tasks(n, f, jobs)]


def file_tasks(n: int, f: DumpFile, jobs: int) -> list[SignalTask]:
    """The signal tasks of ``f``, the ``n``-th file of the compare (none when unusable)."""
    if not f.usable:
        return []
    table = f.records if f.stats_index is None else f.stats_index
    keys = with_experts(present_keys(table, stack_input=NORM in f.site_roles),
                        expert_sites(f.sites, f.site_roles))
    parts = chunks(table, keys, jobs) if jobs > 1 and len(keys) > 1 else [keys]
    return [SignalTask(n, f.path, part, f.layers, f.sites, f.site_roles) for part in parts]
