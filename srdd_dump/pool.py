"""Run independent tasks in this process (jobs=1) or on a process pool, results in task order."""

from __future__ import annotations

import multiprocessing
import threading
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
    with ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=ctx,
                             initializer=pin_for_process) as pool:
        return share(tasks, fn, fn, pool, min(workers, len(tasks)), bar.update)


def share(
    tasks: Sequence[T], local: Callable[[T], R], remote: Callable[[T], R], pool,
    workers: int, done: Callable[[], object] | None = None,
) -> list[R]:
    """``[local(t) for t in tasks]``, with ``workers`` processes of ``pool`` running
    ``remote(t)`` (module-level) alongside this one. Tasks are handed out in order to whoever is
    free first: a worker gets its next task the moment it returns one (a done callback), this
    process takes the next when it finishes its own. Nothing waits queued behind a busy
    process, so at the end nobody idles while another still has a queued task. ``done`` is
    called once per finished task. A worker's exception is raised here after this process has
    run every task not yet handed out."""
    results: list = [None] * len(tasks)
    order = iter(range(len(tasks)))
    lock = threading.RLock()
    futures: list = []  # (future, index)
    left: list[int] = []  # tasks a broken pool refused: run here

    def feed(finished=None) -> None:  # never raises: it runs as a future's callback
        if finished is not None:
            if finished.cancelled() or finished.exception() is not None:
                return
            if done is not None:
                done()
        with lock:
            n = next(order, None)
            if n is None:
                return
            try:
                fut = pool.submit(remote, tasks[n])
            except Exception:  # noqa: BLE001 (a broken or closed pool)
                left.append(n)
                return
            futures.append((fut, n))
        fut.add_done_callback(feed)

    for _ in range(workers):
        feed()
    while True:
        with lock:
            n = next(order, None)
            n = n if n is not None else (left.pop() if left else None)
        if n is None:
            break
        results[n] = local(tasks[n])
        if done is not None:
            done()
    for fut, n in futures:
        results[n] = fut.result()
    return results
