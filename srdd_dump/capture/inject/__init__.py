"""Capture inside an unmodified program (``srdd-dump --exec``).

``srdd-dump`` puts ``site/`` on PYTHONPATH, so every Python process the command starts runs
``site/sitecustomize.py``, which calls :func:`install`. Nothing happens until the program
imports torch; then a global module pre-hook watches forwards, and the first module whose forward
runs and that holds a block stack gets a :class:`CaptureSession`. The global hook is then removed.
This module must stay importable without torch.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import json
import os
import sys

from ..config import ENV_STATUS_DIR, DumpConfig

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")

_state: dict = {"config": None, "session": None, "no_blocks": None, "error": None}


def install() -> None:
    config = DumpConfig.from_env()
    if config is None:
        return
    _state["config"] = config
    atexit.register(_report_status)
    if "torch" in sys.modules:
        _on_torch_imported()
    else:
        sys.meta_path.insert(0, _TorchWatcher())


class _TorchWatcher(importlib.abc.MetaPathFinder):
    """Runs _on_torch_imported right after ``import torch`` finishes, without importing it."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            _on_torch_imported()

        spec.loader.exec_module = exec_module
        return spec


def _on_torch_imported() -> None:
    try:
        from .attach import watch_forwards

        watch_forwards(_state)
    except Exception as exc:  # never break the user's import of torch
        _state["error"] = f"{type(exc).__name__}: {exc}"
        sys.stderr.write(f"srdd-dump: warning: capture not installed: {_state['error']}\n")


def _compiled_out() -> bool:
    """A hook was compiled out of a fullgraph=True graph (capture/compiled.py, if loaded)."""
    compiled = sys.modules.get("srdd_dump.capture.compiled")
    return bool(compiled is not None and compiled._state.get("compiled_out"))


def _report_status() -> None:
    session = _state.get("session")
    if session is not None:
        session.close()
    status_dir = os.environ.get(ENV_STATUS_DIR)
    if not status_dir or not os.path.isdir(status_dir):
        return
    status = {
        "pid": os.getpid(),
        "argv": sys.argv,
        "file": getattr(session, "path", None),
        "samples": (session.sample + 1) if session is not None else 0,
        "error": getattr(session, "error", None) or _state.get("error"),
        "no_blocks": _state.get("no_blocks"),
        "model_seen": session is not None,
        "silence": getattr(session, "silence", None),
        "compiled_out": _compiled_out(),
    }
    try:
        with open(os.path.join(status_dir, f"{os.getpid()}.json"), "w") as fh:
            json.dump(status, fh)
    except OSError:
        pass
