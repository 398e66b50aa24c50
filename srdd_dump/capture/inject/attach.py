"""The global forward watcher that attaches a CaptureSession to the first model with blocks."""

from __future__ import annotations

import os
import sys
import threading
import traceback
import weakref
from typing import Callable

from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from ...errors import UserError
from ...runtime.terminal import say
from ..compiled import opaque
from ..discovery import NoBlocksFound, find_blocks

_attaching = threading.RLock()  # held while a session is made


def _renew_lock() -> None:
    """A child forked while a session was being made: the lock's holder is not there."""
    global _attaching
    _attaching = threading.RLock()


os.register_at_fork(after_in_child=_renew_lock)


def watch_forwards(state: dict, on_attach: Callable[[], None] = lambda: None,
                   on_refused: Callable[[], None] = lambda: None) -> None:
    """Attach a session to the first module with blocks whose forward runs (``on_attach`` runs
    once one is this process's capture; ``on_refused`` when the options do not fit that model,
    with the reason in ``state["refused"]``). ``state["session"]`` is then a weak reference to
    it, ``state["end"]`` what it leaves when it closes."""
    seen: set[int] = set()
    handle = None

    @opaque  # inside code torch.compile traces too: run eagerly, at a graph break
    def on_forward(module: nn.Module, args: tuple) -> None:
        if state.get("session") is not None or id(module) in seen:
            return
        with _attaching:  # threads running the model at once: the first attaches, once
            if state.get("session") is None and id(module) not in seen:
                attach(module, args)

    def attach(module: nn.Module, args: tuple) -> None:
        if _compiled_graph(module, args):
            seen.update(id(m) for m in module.modules())
            return
        generating = _assistant_of(module, state)
        if generating is not None:
            # an assistant (draft) model run inside another model's generate: the model the
            # program generates with is the one to capture
            seen.update(id(m) for m in module.modules())
            say(f"srdd-dump: note: {type(module).__name__} runs inside "
                             f"{type(generating).__name__}.generate (an assistant model): "
                             "not captured\n")
            return
        # Imported at the first forward, not when torch is imported: a script that imports
        # srdd_dump (hence torch) first would otherwise meet a half-initialised hooks module.
        from ..hooks import AlreadyCaptured, CaptureSession

        try:
            session = CaptureSession(module, state["config"])
            # held weakly: a program that drops its model frees it (the session goes with it)
            state["session"], state["end"] = weakref.ref(session), session.end
            # the program's own register_hook after this forward takes the model over: its
            # session is then this process's capture
            session.on_hand_over = lambda new: state.update(session=weakref.ref(new),
                                                            end=new.end)
            # this very call started before the session's own pre-hook existed: it gets the
            # call's keyword arguments (the attention mask of a padded prefill) here
            session.on_model_call(module, args, _call_kwargs(module))
        except AlreadyCaptured as exc:
            # the program's own register_hook came first: its session is this process's
            # capture (its file, in its own folder, is what srdd-dump lists)
            state["session"], state["end"] = weakref.ref(exc.session), exc.session.end
            say(
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
            say(f"srdd-dump: warning: capture not started: {state['error']}\n")
        else:
            on_attach()
            watch_later_models(state)
        handle.remove()

    handle = register_module_forward_pre_hook(on_forward)


def _compiled_graph(module: nn.Module, args: tuple) -> bool:
    """A graph torch.compile produced, or a module called while it traces: torch 2.1 runs a
    graph as an fx GraphModule (or the OptimizedModule around one) called as a module, and
    calls the model's modules on fake tensors while tracing it. Never a model to capture."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled or traced in this process
        return False
    import torch.fx
    from torch._subclasses.fake_tensor import FakeTensor

    return (isinstance(getattr(module, "_orig_mod", module), torch.fx.GraphModule)
            or any(isinstance(a, FakeTensor) for a in args))


def watch_later_models(state: dict) -> None:
    """Say once when another block stack is built after capture began (a second model loaded
    in the same process: another dtype, a worker loading a model per task): srdd-dump
    captures one model per process. Called when a module is assigned to another, so only
    while models are built: nothing on the forward path."""
    def on_register(parent: nn.Module, name: str, value: nn.Module) -> None:
        try:
            if not _a_later_stack(value, state):
                return
        except Exception:  # noqa: BLE001 (a module it cannot read: the user's build goes on)
            return
        state["later_model"] = (f"{type(parent).__name__}.{name}: {len(value)} x "
                                f"{type(value[0]).__name__}")
        say(
            f"srdd-dump: note: another model was built after capture began ({state['later_model']}"
            f", pid {os.getpid()}): srdd-dump captures the first model that runs in a process; "
            "capture another one with register_hook in the script\n")

    try:
        from torch.nn.modules.module import register_module_module_registration_hook
    except ImportError:  # an older torch: no note
        return
    register_module_module_registration_hook(on_register)


def _a_later_stack(value: nn.Module, state: dict) -> bool:
    """A block stack (a ModuleList of 2+ modules of one class holding parameters) other than
    the captured one, and the first one said."""
    if (state.get("later_model") or not isinstance(value, nn.ModuleList) or len(value) < 2
            or len({type(m) for m in value}) != 1):
        return False
    if not any(True for m in value for _ in m.parameters()):
        return False
    ref = state.get("session")
    if ref is None:  # no session here yet (a forked child's own model): its first forward starts
        return False
    captured = {id(b) for _, b in getattr(ref(), "blocks", ())}
    return not any(id(m) in captured for m in value)


def _assistant_of(module: nn.Module, state: dict) -> nn.Module | None:
    """The model whose ``generate`` runs ``module``, a model with blocks of its own (an
    assistant); None otherwise."""
    try:
        generating = _generating_model()
        if generating is None or generating is module or any(
                m is module for m in generating.modules()):
            return None
        find_blocks(module, state["config"].layers)
        return generating
    except Exception:  # noqa: BLE001 (NoBlocksFound, or a module it cannot read: not one)
        return None


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
