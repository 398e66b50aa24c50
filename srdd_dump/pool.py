"""Run independent tasks in this process (jobs=1) or on a process pool, results in task order."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, TypeVar

from tqdm import tqdm

from .streaming import close_readers

T = TypeVar("T")
R = TypeVar("R")


def run_tasks(
    fn: Callable[[T], R], tasks: Sequence[T], jobs: int = 1, *, show: bool = False,
    desc: str = "compare",
) -> list[R]:
    """``[fn(t) for t in tasks]``, on ``jobs`` worker processes when jobs > 1.

    ``fn`` must be a module-level function. Workers are spawned, never forked: the parent may
    hold HDF5 or torch state that a fork would copy. Readers opened by tasks run here are closed
    at the end; workers keep theirs until they exit.
    """
    bar = tqdm(total=len(tasks), desc=desc, unit="task", disable=not show, leave=False)
    try:
        return list(_progress(_results(fn, tasks, jobs), bar))
    finally:
        bar.close()


def _results(fn, tasks, jobs) -> Iterator:
    if jobs <= 1 or len(tasks) <= 1:
        try:
            for task in tasks:
                yield fn(task)
        finally:
            close_readers()
        return
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=ctx) as pool:
        yield from pool.map(fn, tasks, chunksize=1)


def _progress(results: Iterator, bar) -> Iterator:
    for result in results:
        bar.update()
        yield result
