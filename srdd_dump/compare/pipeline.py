"""The one scan loop of every compare mode: tasks shared by this process and ``jobs - 1``
workers, BLAS at one thread in each, readers closed at the end.

A mode plans picklable tasks and gives a module-level function that runs one (it opens its
readers with ``sources.open_reader``); ``scan`` returns the results in task order.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from concurrent.futures import BrokenExecutor
from typing import Callable, TypeVar

from ..analysis import sums
from ..errors import UserError
from ..runtime.blas import one_blas_thread, pin_blas_for_process
from ..runtime.memory import keep_freed_memory, keeps_freed_memory
from ..runtime.pool import run_tasks
from .readers import close_readers

T = TypeVar("T")
R = TypeVar("R")


def check_jobs(jobs: int) -> None:
    if jobs < 1:
        raise UserError(f"--jobs {jobs}: must be at least 1")


def scan(
    run_task: Callable[[T], R], tasks: Sequence[T], jobs: int = 1, *, progress: bool = False,
    desc: str = "compare",
) -> list[R]:
    """``[run_task(t) for t in tasks]`` on ``jobs`` processes, in task order."""
    init = functools.partial(_init_worker, keeps_freed_memory())
    try:
        with single_threaded_kernels():
            return run_tasks(run_task, tasks, jobs, show=progress, desc=desc, worker_init=init)
    except BrokenExecutor:
        raise UserError(
            "a compare worker process died (out of memory? a crash inside HDF5 on a corrupt "
            "file? or, from Python code, a compare with jobs > 1 called outside "
            "`if __name__ == '__main__':`); run with -j 1 to see which file") from None
    finally:
        close_readers()


@contextlib.contextmanager
def single_threaded_kernels() -> Iterator[None]:
    """BLAS at one thread, and the analysis kernels' dot products through it when one was
    found (``analysis.sums``); both restored after the block."""
    with one_blas_thread() as found:
        before = sums.use_blas(found)
        try:
            yield
        finally:
            sums.use_blas(before)


def _init_worker(keep_memory: bool) -> None:
    """A worker process: the parent's memory setting, one BLAS thread for its life."""
    if keep_memory:
        keep_freed_memory()
    sums.use_blas(pin_blas_for_process())
