"""The global forward watcher that attaches a CaptureSession to the first model with blocks."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from ...errors import UserError
from ..compiled import opaque
from ..discovery import NoBlocksFound, find_blocks


def watch_forwards(state: dict, on_attach: Callable[[], None] = lambda: None,
                   on_refused: Callable[[], None] = lambda: None) -> None:
    """Attach a session to the first module with blocks whose forward runs (``on_attach`` runs
    once one is this process's capture; ``on_refused`` when the options do not fit that model,
    with the reason in ``state["refused"]``)."""
    seen: set[int] = set()
    handle = None

    @opaque  # inside code torch.compile traces too: run eagerly, at a graph break
    def on_forward(module: nn.Module, args: tuple) -> None:
        if state.get("session") is not None or id(module) in seen:
            return
        generating = _generating_model()
        if generating is not None and generating is not module and not any(
                m is module for m in generating.modules()) and _has_blocks(module, state):
            # an assistant (draft) model run inside another model's generate: the model the
            # program generates with is the one to capture
            seen.update(id(m) for m in module.modules())
            sys.stderr.write(f"srdd-dump: note: {type(module).__name__} runs inside "
                             f"{type(generating).__name__}.generate (an assistant model): "
                             "not captured\n")
            return
        # Imported at the first forward, not when torch is imported: a script that imports
        # srdd_dump (hence torch) first would otherwise meet a half-initialised hooks module.
        from ..hooks import AlreadyCaptured, CaptureSession

        try:
            state["session"] = session = CaptureSession(module, state["config"])
            # this very call started before the session's own pre-hook existed: it gets the
            # call's keyword arguments (the attention mask of a padded prefill) here
            session.on_model_call(module, args, _call_kwargs(module))
        except AlreadyCaptured as exc:
            # the program's own register_hook came first: its session is this process's
            # capture (its file, in its own folder, is what srdd-dump lists)
            state["session"] = exc.session
            sys.stderr.write(
                "srdd-dump: note: the program captures its model itself (register_hook): its "
                f"own options apply in pid {os.getpid()}, not srdd-dump's\n")
            on_attach()
        except NoBlocksFound as exc:
            # Remember why, and never look at this module or its children again.
            state["no_blocks"] = str(exc)
            seen.update(id(m) for m in module.modules())
            return
        except UserError as exc:
            # options that do not fit this model (--inject layer=K of a block it lacks): the
            # run would capture nothing, and the model has not run yet
            state["refused"] = str(exc)
            handle.remove()
            on_refused()
            return
        except Exception as exc:
            if state["config"].debug:
                traceback.print_exc()
            state["error"] = f"{type(exc).__name__}: {exc}"
            sys.stderr.write(f"srdd-dump: warning: capture not started: {state['error']}\n")
        else:
            on_attach()
        handle.remove()

    handle = register_module_forward_pre_hook(on_forward)


def _has_blocks(module: nn.Module, state: dict) -> bool:
    try:
        find_blocks(module, state["config"].layers)
    except NoBlocksFound:
        return False
    return True


def _generating_model() -> nn.Module | None:
    """The module whose ``generate`` call is the outermost one running now (None if none)."""
    frame, found = sys._getframe(2), None
    while frame is not None:
        if frame.f_code.co_name == "generate":
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module):
                found = owner
        frame = frame.f_back
    return found


def _call_kwargs(module: nn.Module) -> dict:
    """The keyword arguments of the call of ``module`` now starting: a global pre-hook is
    given only the positional ones, so they are read from torch's calling frame ({} when not
    found)."""
    frame = sys._getframe(1)
    for _ in range(6):
        frame = frame.f_back
        if frame is None:
            break
        local = frame.f_locals
        if local.get("self") is module and isinstance(local.get("kwargs"), dict):
            return local["kwargs"]
    return {}
