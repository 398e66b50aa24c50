"""Run independent tasks in this process (jobs=1) or shared with a pool of spawned worker
processes (concurrent.futures), results in task order."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import CancelledError, Executor, Future, ProcessPoolExecutor
from importlib.machinery import ModuleSpec
from typing import Callable, TypeVar

from ..errors import UserError
from .terminal import LazyBar

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
    desc: str = "compare", worker_init: Callable[[], object] | None = None,
    pool: ProcessPoolExecutor | None = None, heads: Sequence[Future] = (),
) -> list[R]:
    """``[fn(t) for t in tasks]``, shared by ``jobs`` processes when jobs > 1: this one and
    ``jobs - 1`` spawned workers (``worker_init`` runs once in each). Each task goes to whoever
    is free first (see ``share``).

    ``fn`` and ``worker_init`` must be module-level functions (or partials of them). Workers
    started here are spawned: the parent may hold HDF5 or torch state that a fork would copy.
    ``pool``: the ``jobs - 1`` workers started earlier (``start_pool``, perhaps forked), used
    and released here; ``heads``: the futures of their head starts (``share``), used even for
    a single task.
    """
    bar = LazyBar(len(tasks), desc, "task", enabled=show)  # tqdm imported at its first update
    done = bar.update
    try:
        if jobs <= 1 or (len(tasks) <= 1 and not heads):
            if pool is not None:
                release(pool)
            out = []
            for task in tasks:
                out.append(fn(task))
                done()
            return out
        workers = min(jobs - 1, len(tasks))
        running = pool if pool is not None else start_pool(workers, worker_init)
        try:
            return share(tasks, fn, fn, running, workers, done, heads)
        finally:
            release(running)
    finally:
        bar.close()


class WorkerPool(ProcessPoolExecutor):
    """A pool of ``start_pool``: ``forked`` says how its workers were started."""

    forked = False


_ending: list[threading.Thread] = []  # shutdowns of forked pools, waited for by ``reap``


def release(pool: ProcessPoolExecutor, reaped: bool = True) -> None:
    """Shut ``pool`` down. A forked one ends on a thread of its own, waited for by ``reap``:
    its workers end while this process writes its report (20 ms at the end of every
    compare); not ``reaped``: not waited for at all (a user error: a worker may be busy
    with its head start, and ends when this process does). A spawned one now: the
    resource tracker holds its semaphores until then."""
    if not getattr(pool, "forked", False):
        pool.shutdown(wait=True, cancel_futures=True)
        return
    if not reaped:
        pool.shutdown(wait=False, cancel_futures=True)
        return
    ending = threading.Thread(target=pool.shutdown, kwargs={"cancel_futures": True},
                              name="srdd-pool-end")
    ending.start()
    _ending.append(ending)


def reap() -> None:
    """Wait for the pools ``release`` left ending: no worker outlives this process."""
    while _ending:
        _ending.pop().join()


def start_pool(workers: int, initializer: Callable[[], object] | None = None,
               warm: Callable[[], object] | None = None, fork: bool = False
               ) -> WorkerPool:
    """``workers`` worker processes, each running ``initializer`` first, started now (each is
    handed ``warm``, a module-level function, e.g. one that imports what its tasks need), not
    at the first task. They are spawned; ``fork``: forked where ``can_fork`` (a worker then
    starts in milliseconds with this process's imports, not in about 0.2 s of CPU)."""
    check_can_spawn(workers + 1)
    method = "fork" if fork and can_fork() else "spawn"
    pool = WorkerPool(max_workers=max(1, workers), mp_context=multiprocessing.get_context(method),
                      initializer=functools.partial(_orphan_proof, initializer))
    pool.forked = method == "fork"
    with _main_left_alone():
        for _ in range(max(1, workers)):
            pool.submit(warm or _nothing)
    return pool


def can_fork() -> bool:
    """A fork copies a clean process: Linux (macOS's system libraries, numpy's Accelerate
    BLAS among them, break in a forked child), no Python thread but this one, and no torch
    (its threads and device state). The caller vouches for the rest: no HDF5 file open."""
    return (sys.platform.startswith("linux") and threading.active_count() == 1
            and "torch" not in sys.modules)


def _orphan_proof(initializer: Callable[[], object] | None) -> None:
    """A worker ends itself when its parent is gone: a parent that leaves by ``os._exit``
    (the watchdog's child, a user error after the workers were started early) never shuts
    its pool down, and a worker left waiting on its queue would live on, holding the
    parent's stdout and stderr open (``out=$(srdd-compare ...)`` would never return)."""
    # Ctrl-C reaches the whole process group: the parent stops the compare, a worker
    # interrupted in the middle of sending a result left the parent waiting for the rest
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        def watch() -> None:
            multiprocessing.connection.wait([parent.sentinel])
            os._exit(0)

        threading.Thread(target=watch, daemon=True, name="srdd-parent-watch").start()
    if initializer is not None:
        initializer()


def _nothing() -> None:
    """A worker's first call when no warm-up is given: it makes the process start."""


_main_is_ours = False  # __main__ is an entry point of this library (``main_is_ours``)


def main_is_ours() -> None:
    """Say that ``__main__`` is an entry point of this library (the srdd-compare command), which
    spawned workers need not run again. A user's script stays what multiprocessing re-runs in
    each worker (hence its ``__main__`` guard, ``check_can_spawn``)."""
    global _main_is_ours
    _main_is_ours = True


@contextlib.contextmanager
def _main_left_alone() -> Iterator[None]:
    """After ``main_is_ours``: while workers are spawned, ``__main__`` shows multiprocessing the
    spec of a package's ``__main__``, which a spawned child does not import again. The workers
    run module-level functions of this library only; re-running the srdd-compare entry point
    (typer and the CLI's imports) cost each one about 0.2 s of CPU before its first task."""
    main = sys.modules.get("__main__")
    if main is None or not _main_is_ours:
        yield
        return
    had, before = hasattr(main, "__spec__"), getattr(main, "__spec__", None)
    main.__spec__ = ModuleSpec("__main__", None)
    try:
        yield
    finally:
        if had:
            main.__spec__ = before
        else:
            del main.__spec__


def share(
    tasks: Sequence[T], local: Callable[[T], R], remote: Callable[[T], R],
    pool: Executor, workers: int, done: Callable[[], object] | None = None,
    heads: Sequence[Future] = (),
) -> list[R]:
    """``[local(t) for t in tasks]``, with ``workers`` processes of ``pool`` running
    ``remote(t)`` (module-level) alongside this one. Tasks are handed out in order to whoever is
    free first: a worker gets its next task the moment it returns one (a done callback), this
    process takes the next when it finishes its own. Nothing waits queued behind a busy
    process, so at the end nobody idles while another still has a queued task. ``done`` is
    called once per finished task. ``heads``: futures the workers already run (at most
    ``workers``), the i-th giving (task, result) for ``tasks[i]``, planned on its own: its
    result is used when its task equals ``tasks[i]``, else that task runs here too.

    The first error stops the hand-out: a worker's (or a pool that broke) is raised here as
    soon as this process finishes the task in hand; one raised here stops the workers getting
    more. Tasks already running in workers are not waited for then."""
    results: list = [None] * len(tasks)
    heads = list(heads)[: min(workers, len(tasks))]
    order = iter(range(len(heads), len(tasks)))
    lock = threading.Lock()
    futures: list[tuple[Future, int]] = []
    failed: list[BaseException] = []  # the first error stops the hand-out
    finished_one = done or (lambda: None)

    def feed(finished: Future | None = None) -> None:  # never raises: a future's callback
        if finished is not None:
            error = CancelledError() if finished.cancelled() else finished.exception()
            if error is not None:
                failed.append(error)
                return
            finished_one()
        with lock:
            n = None if failed else next(order, None)
            if n is None:
                return
            try:
                fut = pool.submit(remote, tasks[n])
            except Exception as exc:  # noqa: BLE001 (a broken pool refuses new work)
                failed.append(exc)
                return
            futures.append((fut, n))
        fut.add_done_callback(feed)

    try:
        with lock:
            futures += [(head, i) for i, head in enumerate(heads)]
        for head in heads:
            head.add_done_callback(feed)
        for _ in range(workers - len(heads)):
            feed()
        while not failed:
            with lock:
                n = next(order, None)
            if n is None:
                break
            results[n] = local(tasks[n])
            finished_one()
    except BaseException as exc:
        failed.append(exc)
        raise
    for fut, n in futures:
        if failed:
            raise failed[0]
        results[n] = fut.result()
        if n < len(heads):
            task, results[n] = results[n]
            if task != tasks[n]:  # planned otherwise (a file changed between the plans)
                results[n] = local(tasks[n])
    if failed:
        raise failed[0]
    return results
