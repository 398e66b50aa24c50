"""Run independent tasks in this process (jobs=1) or on a process pool, results in task order."""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, TypeVar

from tqdm import tqdm

from .blas import one_blas_thread, pin_for_process
from .errors import UserError
from .streaming import close_readers

T = TypeVar("T")
R = TypeVar("R")


def check_can_spawn(jobs: int) -> None:
    """A spawned worker re-imports the caller's script; unguarded, that script calls the compare
    again from inside the worker while it is still starting, which multiprocessing refuses.
    ``_inheriting`` is the (private) flag multiprocessing's own check reads."""
    if jobs > 1 and getattr(multiprocessing.current_process(), "_inheriting", False):
        raise UserError("jobs > 1 from a Python script: put the compare call under "
                        "`if __name__ == '__main__':` (worker processes re-import the script)")


def run_tasks(
    fn: Callable[[T], R], tasks: Sequence[T], jobs: int = 1, *, show: bool = False,
    desc: str = "compare",
) -> list[R]:
    """``[fn(t) for t in tasks]``, shared by ``jobs`` processes when jobs > 1: this one and
    ``jobs - 1`` spawned workers. Each idle worker gets the next task (with one more queued),
    and while they are all busy, or still starting, this process runs the next task itself.

    ``fn`` must be a module-level function. Workers are spawned, never forked: the parent may
    hold HDF5 or torch state that a fork would copy. Readers opened by tasks run here are closed
    at the end; workers keep theirs until they exit.
    """
    bar = tqdm(total=len(tasks), desc=desc, unit="task", disable=not show, leave=False)
    try:
        with one_blas_thread():
            if jobs <= 1 or len(tasks) <= 1:
                out = []
                for task in tasks:
                    out.append(fn(task))
                    bar.update()
                return out
            return _shared(fn, tasks, jobs - 1, bar)
    finally:
        close_readers()
        bar.close()


def _shared(fn, tasks, workers: int, bar) -> list:
    check_can_spawn(workers + 1)
    ctx = multiprocessing.get_context("spawn")
    results: list = [None] * len(tasks)
    pending: dict = {}

    def collect(wait: bool) -> None:
        done = list(pending) if wait else [f for f in pending if f.done()]
        for future in done:
            results[pending.pop(future)] = future.result()
            bar.update()

    with ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=ctx,
                             initializer=pin_for_process) as pool:
        for n, task in enumerate(tasks):
            collect(wait=False)
            if len(pending) < 2 * workers:
                pending[pool.submit(fn, task)] = n
            else:
                results[n] = fn(task)
                bar.update()
        collect(wait=True)
    return results
