"""Capture inside an unmodified program (``srdd-dump --exec``).

``srdd-dump`` puts ``site/`` on PYTHONPATH, so every Python process the command starts runs
``site/sitecustomize.py``, which calls :func:`install`. Nothing happens until the program
imports torch; then a global module pre-hook watches forwards, and the first module whose forward
runs and that holds a block stack gets a :class:`CaptureSession`. The global hook is then removed.
This module must stay importable without torch.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import importlib.util
import json
import os
import signal
import sys
import threading
import time
from typing import Callable

from ...runtime.terminal import say
from ..config import ENV_STATUS_DIR, DumpConfig

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")

# "session": a weak reference to this process's CaptureSession (attach.py), "end" what it
# leaves when it closes (hooks.SessionEnd): read after it is gone too
_state: dict = {"config": None, "session": None, "no_blocks": None, "error": None}


def _session():
    """This process's capture session while it lives (None before one attached, or once the
    program dropped its model)."""
    ref = _state.get("session")
    return ref() if ref is not None else None


def install() -> None:
    config = DumpConfig.from_env()
    if config is None or _state["config"] is not None:  # once per process
        return
    _state["config"] = config
    atexit.register(_report_status)
    os._exit = _finishing_first(os._exit)
    os.register_at_fork(after_in_child=_after_fork_in_child)
    if "torch" in sys.modules:
        _on_torch_imported()
    else:
        sys.meta_path.insert(0, ImportWatcher("torch", lambda: _on_torch_imported()))


class ImportWatcher(importlib.abc.MetaPathFinder):
    """Calls ``then()`` right after ``import <name>`` finishes (torch: _on_torch_imported),
    without importing it.

    It stays first on ``sys.meta_path`` until torch has actually been imported: libraries probe
    for torch with ``importlib.util.find_spec("torch")`` long before they import it
    (transformers' import_utils, vLLM's env_override), and a probe must not use it up. Every
    spec it hands out carries a loader that tells, once the module itself has run."""

    def __init__(self, name: str, then: Callable[[], None]):
        self.name, self.then = name, then

    def find_spec(self, name, path=None, target=None):
        if name != self.name or name in sys.modules:
            return None
        try:
            spec = _spec_from_finders_after(self, name, path, target)
            if spec is not None and hasattr(getattr(spec, "loader", None), "exec_module"):
                spec.loader = _TellingLoader(spec.loader, self)
            return spec
        except Exception:  # noqa: BLE001 (the import goes on without the watcher)
            return None


class _TellingLoader(importlib.abc.Loader):
    """Runs the module with its own loader, then tells the watcher's ``then``. The module keeps
    the real loader in ``__loader__`` and ``__spec__.loader`` (importlib.resources reads them)."""

    def __init__(self, loader, watcher: ImportWatcher):
        self._loader, self._watcher = loader, watcher

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self._watcher)
        self._watcher.then()

    def __getattr__(self, name):
        return getattr(self._loader, name)


def _spec_from_finders_after(watcher, name, path, target):
    """What the import system would find without ``watcher`` (never recursing into it)."""
    meta_path = list(sys.meta_path)
    start = meta_path.index(watcher) + 1 if watcher in meta_path else 0
    for finder in meta_path[start:]:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


def _on_torch_imported() -> None:
    if _state.get("watching"):
        return
    _state["watching"] = True
    try:
        # the file library now, not at the program's first forward: its import ends in
        # warnings.catch_warnings, after which a warning the program showed once shows again
        import h5py  # noqa: F401

        from .attach import watch_forwards

        watch_forwards(_state, on_attach=finish_on_sigterm, on_refused=stop_refused)
        # a process killed before it reports (SIGTERM while it loads a model or waits for
        # requests) has imported torch: said so, not "before any process imported torch"
        report_early({})
    except Exception as exc:  # never break the user's import of torch
        _state["error"] = f"{type(exc).__name__}: {exc}"
        say(f"srdd-dump: warning: capture not installed: {_state['error']}\n")


def stop_refused() -> None:
    """Options that do not fit the model (``_state["refused"]``): nothing will be captured in
    this process. It reports at once; srdd-dump, which watches the reports, stops the command
    (every process of it: a Pool worker or an engine's worker process that exited on its own
    would leave the program waiting for it) and exits 2. The program runs on until then."""
    if not os.environ.get(ENV_STATUS_DIR):  # else srdd-dump says it, once for every process
        say(f"srdd-dump: error: {_state['refused']}\n")
    _report_status()


def finish_on_sigterm() -> None:
    """A process told to stop by SIGTERM (a multiprocessing Pool's workers when the program's
    ``with Pool(...)`` block ends: ``Pool.terminate``) finishes its dump file and reports, then
    dies of SIGTERM as it would have. Only where the program left SIGTERM at its default, and
    from the main thread (the only one that may set a handler).

    The handler itself only wakes a waiting thread: the main thread may be stopped inside a
    capture hook or the writer's queue, holding locks a close needs; the thread takes them in
    turn, once the main thread has let them go."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        # SIGHUP too: a closed terminal or ssh session sends it to the whole process group
        ending = [sig for sig in (getattr(signal, name, None) for name in ("SIGTERM", "SIGHUP"))
                  if sig is not None and signal.getsignal(sig) is signal.SIG_DFL]
        if not ending:
            return
        wake, received = threading.Event(), []
        threading.Thread(target=_end_on, args=(wake, received), daemon=True,
                         name="srdd-sigterm").start()

        def on_sigterm(signum, frame) -> None:
            for sig in ending:
                signal.signal(sig, signal.SIG_DFL)
            received.append(signum)
            wake.set()

        for sig in ending:
            signal.signal(sig, on_sigterm)
        _state["sigterm_handler"] = on_sigterm
    except (ValueError, OSError, RuntimeError):  # not settable: the file stays .partial
        pass


def _end_on(wake: threading.Event, received: list[int], timeout: float = 10.0) -> None:
    """Once woken by SIGTERM (or SIGHUP): the file finished and the report written (by this
    thread, or by the process's own exit already under way), then the end the signal asks
    for (the process may well exit on its own first)."""
    wake.wait()
    try:
        hooks = sys.modules.get("srdd_dump.capture.hooks")
        if hooks is not None and received:
            try:  # the main thread may be opening or closing a session: finish the file anyway
                hooks.mark_ended(f"stopped by {signal.Signals(received[0]).name}")
            except RuntimeError:
                pass
        session = _session()
        if session is not None:
            session.stop_asked()
            session.wait_closed()  # a close under way in the main thread
        _report_status()
        deadline = time.monotonic() + timeout
        while not _state.get("status_written") and time.monotonic() < deadline:
            time.sleep(0.05)  # another thread's report under way
    finally:
        os.kill(os.getpid(), received[0] if received else signal.SIGTERM)


def _finishing_first(real_exit: Callable[[int], None], timeout: float = 30.0):
    """``os._exit`` that first finishes this process's dump and report (a program ending with
    ``os._exit(0)`` skips atexit: its file was left unfinished and the run failed). The close
    runs in a thread, waited for at most ``timeout`` s, and not at all when the caller is inside
    the session's hooks (a watchdog's or a signal handler's exit holds what the close needs);
    the exit comes whatever happens."""
    def exit_when_finished(status: int, /) -> None:
        try:
            session = _session()
            if not _state.get("reported") and not (session is not None
                                                   and session.busy_here()):
                closing = threading.Thread(target=_report_status, daemon=True,
                                           name="srdd-exit")
                closing.start()  # raises at interpreter shutdown (Python 3.12): exit anyway
                closing.join(timeout)
        except BaseException:  # noqa: BLE001 (the exit the program asked for comes first)
            pass
        finally:
            real_exit(status)

    exit_when_finished.__wrapped__ = real_exit
    return exit_when_finished


def _after_fork_in_child() -> None:
    """A forked child (multiprocessing fork or forkserver, os.fork) reports for itself: it ends
    with os._exit, past atexit, so its report runs among multiprocessing's exit finalizers. A
    session inherited from the parent is the parent's (its file, its hooks, its faults): it is
    abandoned (kept referenced, never closed) and the child's first model forward starts its
    own."""
    _state["reported"] = _state["status_written"] = False
    handler = _state.pop("sigterm_handler", None)
    for sig in (getattr(signal, name, None) for name in ("SIGTERM", "SIGHUP")):
        if sig is not None and handler is not None and signal.getsignal(sig) is handler:
            # its waiting thread stayed in the parent: the child's own session sets its own
            signal.signal(sig, signal.SIG_DFL)
    inherited = _session()
    _state["end"] = None
    if _state.get("session") is not None:
        _state["session"] = None
        if inherited is not None:
            _state.setdefault("abandoned", []).append(inherited)
            inherited.abandon()
        _state["watching"] = False
        _on_torch_imported()
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:  # run after multiprocessing clears the parent's finalizers
        mp_util.register_after_fork(_report_status, _register_exit_finalizer)


def _register_exit_finalizer(_obj) -> None:
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:
        mp_util.Finalize(None, _report_status, exitpriority=100)


def _finished_files() -> list[str]:
    """Every dump file this process finished (capture/dump_file.py, if loaded): the program's
    own register_hook sessions' too, wherever they write."""
    dump_file = sys.modules.get("srdd_dump.capture.dump_file")
    return dump_file.finished_files() if dump_file is not None else []


def _compiled_out() -> bool:
    """A hook was compiled out of a fullgraph=True graph (capture/compiled.py, if loaded)."""
    compiled = sys.modules.get("srdd_dump.capture.compiled")
    return bool(compiled is not None and compiled.hooks_compiled_out())


def _torch_missing() -> bool:
    """This Python cannot import torch (a compare-only install of srdd-dump)."""
    try:
        return importlib.util.find_spec("torch") is None
    except (ImportError, ValueError):
        return True


def report_early(fields: dict) -> None:
    """What this process knows now, as its status, until it reports at exit (a process killed
    first, as vLLM kills its workers at shutdown, leaves this one)."""
    status_dir = os.environ.get(ENV_STATUS_DIR)
    if not _state.get("reported") and status_dir and os.path.isdir(status_dir):
        _write_status(status_dir, {"pid": os.getpid(), "argv": sys.argv, "files": [],
                                   "early": True, "torch_imported": "torch" in sys.modules,
                                   **fields})


def _write_status(status_dir: str, status: dict) -> None:
    """This process's status file, replaced whole (srdd-dump never reads half of one)."""
    path = os.path.join(status_dir, f"{os.getpid()}.json")
    try:
        with open(path + ".tmp", "w") as fh:
            json.dump(status, fh)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _report_status() -> None:
    if _state.get("reported"):
        _note_exiting()
        return
    _state["reported"] = True
    session = _session()
    if session is not None:
        session.close()
    hooks = sys.modules.get("srdd_dump.capture.hooks")
    if hooks is not None:  # a session dropped outside the main thread waits there
        hooks.close_dropped()
    end = _state.get("end")  # the session's, alive or not
    status_dir = os.environ.get(ENV_STATUS_DIR)
    if not status_dir or not os.path.isdir(status_dir):
        _state["status_written"] = True  # nowhere to write it
        return
    status = {
        "pid": os.getpid(),
        "argv": sys.argv,
        "files": _finished_files(),  # the session's, and the program's own sessions' too
        "samples": end.samples if end is not None else 0,
        "error": getattr(end, "error", None) or _state.get("error"),
        "refused": _state.get("refused"),
        "no_blocks": _state.get("no_blocks"),
        "model_seen": end is not None,
        "silence": getattr(end, "silence", None),
        "blocks_unseen": getattr(end, "blocks_unseen", False),
        "compiled_out": _compiled_out(),
        "degraded": getattr(end, "degraded", []),
        # torch was imported but the watcher never saw it (an import hook placed before it)
        "torch_unwatched": "torch" in sys.modules and not _state.get("watching"),
        "torch_missing": "torch" not in sys.modules and _torch_missing(),
        "torch_imported": "torch" in sys.modules,
        "untested_versions": getattr(end, "version_notes", []),
    }
    _write_status(status_dir, status)
    _state["status_written"] = True
    _state["status"] = status


def _note_exiting() -> None:
    """A process that refused its options (reported at once) and ran on to its own exit says
    so: srdd-dump's stop came after the program's work, which it did not cut short."""
    status, status_dir = _state.get("status"), os.environ.get(ENV_STATUS_DIR)
    if status and status.get("refused") and not status.get("exiting") and status_dir:
        _state["status"] = status = {**status, "exiting": True}
        _write_status(status_dir, status)
