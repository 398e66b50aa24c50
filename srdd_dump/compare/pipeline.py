"""The one scan loop of every compare mode: tasks shared by this process and ``jobs - 1``
workers, BLAS at one thread in each.

A mode plans picklable tasks and gives a module-level function that runs one (it opens its
readers with ``readers.open_reader`` and turns a damaged file's read errors into a result);
``scan`` returns the results in task order. The caller closes this process's readers
(``readers.close_readers``) when its compare ends.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import BrokenExecutor, Future, ProcessPoolExecutor
from typing import Callable, TypeVar

from ..analysis import sums
from ..errors import UserError
from ..runtime.blas import one_blas_thread, pin_blas_for_process
from ..runtime.memory import keep_freed_memory, keeps_freed_memory
from ..runtime.pool import release, run_tasks, start_pool

T = TypeVar("T")
R = TypeVar("R")


# A worker starts while the files are inspected (prestart) but still costs about 0.2 s of CPU:
# measured end to end on 2 cores, -j 2 against -j 1 was 15% slower on a 5 MB stats dump, even
# on 192 MB and 20% faster on 293 MB (docs/benchmarks.md). So one more process per
# BYTES_PER_JOB of dump.
BYTES_PER_JOB = 256 << 20


def check_jobs(jobs: int) -> int:
    """``jobs`` as used: at least 1, at most ``job_cap()`` (a process per core at most: more
    only wait for a core, and -j 100000 forked thousands)."""
    if jobs < 1:
        raise UserError(f"jobs {jobs}: must be at least 1")
    return min(jobs, job_cap())


def job_cap() -> int:
    return max(2, usable_cores())


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. under taskset or cgroups)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_jobs(files: Iterable) -> int:
    """Processes for a compare of ``files`` (DumpFile, or paths): one, and one more per
    BYTES_PER_JOB of dump, up to the usable cores."""
    size = 0
    for f in files:
        try:
            size += os.path.getsize(f if isinstance(f, str) else f.path)
        except OSError:
            pass
    return max(1, min(usable_cores(), size // BYTES_PER_JOB + 1))


# Workers started before the files are inspected (``prestart``): (jobs, the pool, the futures
# of their head starts), taken by the next ``scan`` with as many jobs.
_started: tuple[int, ProcessPoolExecutor, list[Future]] | None = None


def prestart(jobs: int, task_module: str, fork: bool = False,
             head: Callable[[int], tuple[object, object]] | None = None) -> None:
    """Start the ``jobs - 1`` workers of the next scan now, each importing ``task_module``
    (the module of the tasks it will run): a spawned worker takes 0.2-0.3 s to start, which
    then passes while this process inspects the files and plans (and imports what it needs
    after that), not while the work waits. ``fork``: forked where that is safe
    (``runtime.pool.can_fork``), for a caller that has opened no file yet. ``head``: a
    module-level function, ``head(i)`` -> (task, result): the i-th task of the plan this
    process will make, planned by a worker on its own, and its result; the workers run
    ``head(0)`` .. ``head(jobs - 2)`` at once instead of waiting for this process's plan
    (``runtime.pool.share`` uses a result where the task is the scan's task of that index).
    Nothing happens with one job or when workers are already started; ``discard_started``
    ends workers no scan took."""
    global _started
    if jobs <= 1 or _started is not None:
        return
    init = functools.partial(_init_worker, keeps_freed_memory())
    pool = start_pool(jobs - 1, init, functools.partial(_import, task_module), fork=fork)
    heads = [pool.submit(head, i) for i in range(jobs - 1)] if head is not None else []
    _started = (jobs, pool, heads)


def workers_started() -> bool:
    """Whether ``prestart`` started workers that no scan took yet."""
    return _started is not None


def discard_started() -> None:
    """End the workers ``prestart`` started if no scan took them (a user error): forked ones
    are not waited for (one may be reading its head start; they end with this process),
    spawned ones are (``runtime.pool.release``)."""
    global _started
    if _started is not None:
        pool, _started = _started[1], None
        release(pool, reaped=False)


def _take(jobs: int) -> tuple[ProcessPoolExecutor | None, list[Future]]:
    global _started
    if _started is None or _started[0] != jobs:
        discard_started()
        return None, []
    (_, pool, heads), _started = _started, None
    return pool, heads


def _import(module: str) -> None:
    importlib.import_module(module)


def scan(
    run_task: Callable[[T], R], tasks: Sequence[T], jobs: int = 1, *, progress: bool = False,
    desc: str = "compare",
) -> list[R]:
    """``[run_task(t) for t in tasks]`` on ``jobs`` processes, in task order."""
    init = functools.partial(_init_worker, keeps_freed_memory())
    pool, heads = _take(jobs)
    with single_threaded_kernels():
        try:
            return run_tasks(run_task, tasks, jobs, show=progress, desc=desc, worker_init=init,
                             pool=pool, heads=heads)
        except BrokenExecutor:
            if jobs <= 1:
                raise
        # A worker died (out of memory, or a crash inside HDF5 on a corrupt file): the same
        # work in this process alone, where the command's watchdog names a file that crashes.
        sys.stderr.write("srdd-compare: warning: a worker process died; running the compare "
                         "again in one process\n")
        return run_tasks(run_task, tasks, 1, show=progress, desc=desc)


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
