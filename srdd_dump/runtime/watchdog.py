"""Stall guard for srdd-compare: a damaged HDF5 file can make the HDF5 library loop forever
inside one call while it holds the GIL, where no thread or signal handler of the process can
stop it (seen with one flipped bit in a global heap).

``supervise(run)`` forks: the child runs the command, this process watches. The child calls
``arm(timeout)`` once its options are parsed; from then on the reader reports, through shared
memory, when an HDF5 access starts and ends and on which file. An access that lasts longer
than ``timeout`` seconds gets the child killed and the command fails with one line naming the
file, exit code 2; so does a child that crashes (SIGSEGV...). Without ``fork`` (Windows)
``run`` is called directly and nothing is guarded. ``leave`` ends the command's process after
``supervise``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import signal
import struct
import sys
import time
import traceback
from typing import Callable, NoReturn

from .terminal import terminal_delivers_to_child

EXIT_STALLED = 2  # a read that hangs or crashes ends like any other bad input
_CRASHES = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}
_POLL = 0.05
_STATE = struct.Struct("<ddI")  # timeout (0 = off), access start (monotonic, 0 = idle), len
_SIZE = 4096
_shared: mmap.mmap | None = None  # set in the supervised child
_watched = False  # this process watched a child that ran the command


def supervise(run: Callable[[], int], prog: str) -> int:
    """Run ``run`` (returning an exit code) in a watched child; returns the exit code."""
    global _shared, _watched
    if not hasattr(os, "fork"):
        return run()
    shared = mmap.mmap(-1, _SIZE)  # anonymous and shared with the child
    _flush()
    pid = os.fork()
    if pid == 0:
        _shared = shared
        os._exit(_run_child(run, prog))
    _watched = True
    return _watch(pid, shared, prog)


def leave(code: int) -> NoReturn:
    """Exit the command with ``code``. A process that only watched (``supervise`` forked)
    holds no file and no worker: its streams are flushed and the interpreter's teardown of its
    imports (about 80 ms) is skipped."""
    if not _watched:
        sys.exit(code)
    _flush()
    os._exit(code)


def arm(timeout: float) -> Callable[[str | None], None] | None:
    """In the supervised child: guard accesses from now on (``timeout`` <= 0: off). Returns
    the monitor the reader must call around each access (``set_read_monitor``), or None."""
    if _shared is None or timeout <= 0:
        return None
    _STATE.pack_into(_shared, 0, float(timeout), 0.0, 0)
    return _publish


def _publish(path: str | None) -> None:
    if path is None:
        struct.pack_into("<d", _shared, 8, 0.0)
        return
    name = os.fsencode(path)[: _SIZE - _STATE.size]
    _shared[_STATE.size : _STATE.size + len(name)] = name
    struct.pack_into("<dI", _shared, 8, time.monotonic(), len(name))


def _run_child(run: Callable[[], int], prog: str) -> int:
    try:
        code = run() or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except KeyboardInterrupt:  # before the command's own handler (its start-up)
        with contextlib.suppress(Exception):
            sys.stderr.write(f"{prog}: interrupted\n")
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    _flush()
    return code


def _flush() -> None:
    """Flush stdout and stderr, either closed (``>&-``: None) or failing."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.flush()


def _exit_event(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` ends (Linux 5.3+), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _watch(pid: int, shared: mmap.mmap, prog: str) -> int:
    def forward(signum, frame):
        if signum == signal.SIGINT and terminal_delivers_to_child():
            return  # Ctrl-C at a terminal reached the child too
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    ended = _exit_event(pid)
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            timeout, started, length = _STATE.unpack_from(shared, 0)
            path = os.fsdecode(shared[_STATE.size : _STATE.size + length])
            if done:
                code = os.waitstatus_to_exitcode(status)
                if code >= 0:
                    return code
                if -code in _CRASHES:  # a fault inside a C library, not a signal from outside
                    where = f"{path}: " if started > 0 else ""
                    hint = " inside the HDF5 library (a damaged file?)" if started > 0 else ""
                    name = signal.Signals(-code).name
                    sys.stderr.write(f"{prog}: error: {where}crashed with {name}{hint}\n")
                    return EXIT_STALLED
                if -code == signal.SIGKILL:  # not from this command: the kernel's OOM killer?
                    sys.stderr.write(f"{prog}: error: killed (SIGKILL: out of memory?)\n")
                return 128 - code
            if timeout > 0 and started > 0 and time.monotonic() - started > timeout:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                sys.stderr.write(
                    f"{prog}: error: {path}: reading stalled for {timeout:g} s inside the HDF5 "
                    "library (a damaged file?); move the file away or raise --read-timeout\n"
                )
                return EXIT_STALLED
            if ended is None:
                time.sleep(_POLL)
            else:  # wakes the moment the child ends, not up to _POLL later
                select.select([ended], [], [], _POLL)
    finally:
        if ended is not None:
            os.close(ended)
        for s, handler in previous.items():
            signal.signal(s, handler)

