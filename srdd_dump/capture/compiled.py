"""Capture and ``torch.compile``.

Dynamo inlines a module's hooks into the code it compiles, and by default never looks at them
again (``torch._dynamo.config.skip_nnmodule_hook_guards``): hooks present when the model is
first traced are compiled in, hooks added later never run inside the compiled region.

So every capture hook is :func:`opaque`: dynamo does not trace into it but calls it at a graph
break, eagerly, with the real tensors, so capture records what the compiled model computed (at
the cost of a graph break at each hook). Hooks registered after the model was compiled and run
cannot be seen; :func:`explain_silence` words what the session then says instead of writing an
empty dump.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, NamedTuple, TypeVar

import torch
from torch import nn

try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback
except Exception:  # noqa: BLE001 (another torch)
    get_eval_frame_callback = None
try:  # torch < 2.3 has no getter: the setter returns the callback it replaces
    _set_eval_frame = torch._C._dynamo.eval_frame.set_eval_frame
except Exception:  # noqa: BLE001 (another torch)
    _set_eval_frame = None

from .option_names import option

F = TypeVar("F", bound=Callable)

EAGER_HINT = ("run it eagerly: srdd-dump --eager, or TORCHDYNAMO_DISABLE=1 in the "
              "environment (torch.compile then returns the model unchanged)")
LATE_HINT = "register_hook before the compiled model's first call, or " + EAGER_HINT


_state = {
    "compiled_out": False,  # a hook was compiled out of a graph that allows no break
    "from_compiled": False,  # the last hook was called at a graph break of compiled code
}


def _graph_breaks_allowed() -> bool:
    """Whether the graph dynamo is tracing may break (not ``fullgraph=True``). Dynamo calls
    this once while tracing and keeps the answer as a constant (``assume_constant_result``)."""
    try:
        tx = _tracer()
        allowed = not (tx.one_graph or getattr(tx, "error_on_graph_break", False))
    except Exception:  # noqa: BLE001 (another torch: never break a graph then)
        allowed = False
    if not allowed and not _state["compiled_out"]:
        _state["compiled_out"] = True
        _report_now()
    return allowed


def _report_now() -> None:
    """Under --exec: say at once that the hooks were compiled out (a serving engine's worker is
    killed at shutdown, before it could say so at exit)."""
    inject = sys.modules.get("srdd_dump.capture.inject")
    if inject is not None:
        try:
            inject.report_early({"model_seen": True, "compiled_out": True,
                                 "silence": _compiled_out_silence()})
        except Exception:  # noqa: BLE001 (inside the user's compile: never fail it)
            pass


def _compiled_out_silence() -> str:
    return ("no block hook ran: the model is compiled with fullgraph=True (as vLLM compiles "
            "it), where a hook cannot break the graph, so the hooks were compiled out; "
            f"{eager_hint()}")


def _tracer():
    """The root instruction translator of the graph dynamo is tracing: its ``current_tx``
    (torch >= 2.3); before, the ``self`` of a calling frame (without it every compiled graph
    was taken for a fullgraph one and its hooks compiled out, on torch 2.1)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator, InstructionTranslatorBase

    current = getattr(InstructionTranslator, "current_tx", None)
    if current is not None:
        return current()
    frame = sys._getframe(1)
    while frame is not None:
        tx = frame.f_locals.get("self")
        if isinstance(tx, InstructionTranslatorBase):
            while getattr(tx, "parent", None) is not None:
                tx = tx.parent
            return tx
        frame = frame.f_back
    raise LookupError("no instruction translator on the stack")


def opaque(fn: F) -> F:
    """``fn`` as a hook dynamo never traces into: in a compiled graph it is called at a graph
    break, eagerly, with the real tensors; in a graph that may not break (``fullgraph=True``,
    as vLLM compiles) it does nothing, so the user's compile still succeeds."""
    try:  # torch without a working dynamo (torch 2.1 on Python 3.12): hooks as they are
        import torch._dynamo as dynamo

        eager = torch.compiler.disable(fn)
        allowed = dynamo.assume_constant_result(_graph_breaks_allowed)
        is_compiling = getattr(torch.compiler, "is_compiling", None) or dynamo.is_compiling
    except Exception:  # noqa: BLE001
        return fn

    @functools.wraps(fn)
    def hook(*args, **kwargs):
        if is_compiling():  # tracing: constants, and no graph break before eager
            if not allowed():
                return None
        else:  # running (after a graph break, this frame is never traced)
            active = _state["from_compiled"] = _dynamo_active()
            if active is False:  # plain eager code: no frame callback to keep out of ``fn``
                return fn(*args, **kwargs)
        return eager(*args, **kwargs)

    _HOOK_CODES.add(hook.__code__)
    skip_hook_frames()
    return hook  # type: ignore[return-value]


_HOOK_CODES: set = set()


class opaque_method:  # noqa: N801 (used as a decorator, like a function)
    """:func:`opaque` for a method: each instance's attribute is an opaque plain function bound
    to it (made at the first look-up, kept on the instance until :meth:`forget`). Dynamo
    before torch 2.3 cannot call a bound method of an object of ours inside a graph (a
    ``fullgraph=True`` compile then failed in the user's program, on torch 2.1); a plain
    function it inlines, and compiles out there."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.name = fn.__name__
        functools.update_wrapper(self, fn)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> Callable:
        if obj is None:
            return self
        fn = self.fn

        @functools.wraps(fn)
        def bound(*args, **kwargs):
            return fn(obj, *args, **kwargs)

        hook = obj.__dict__[self.name] = opaque(bound)
        return hook

    @staticmethod
    def forget(obj: object) -> None:
        """Drop ``obj``'s kept functions (each holds ``obj``: a cycle) once its hooks are
        removed, so that it is freed without waiting for the garbage collector."""
        for cls in type(obj).__mro__:
            for name, value in vars(cls).items():
                if isinstance(value, opaque_method):
                    obj.__dict__.pop(name, None)


def _dynamo_active() -> bool | None:
    """Dynamo's frame callback is set: the hook runs at a graph break of compiled code (None:
    this torch does not tell). (No name of torch in here: dynamo then never compiles this
    frame, as it runs among the frames of a compiled call on torch 2.1.)"""
    try:
        if get_eval_frame_callback is not None:
            return get_eval_frame_callback() not in (None, False)
        if _set_eval_frame is None:
            return None
        callback = _set_eval_frame(None)
        _set_eval_frame(callback)
        return callback not in (None, False)
    except Exception:  # noqa: BLE001 (another torch)
        return None


def called_from_compiled() -> bool:
    """The hook running now was called from torch.compile'd code (at a graph break)."""
    return bool(_state["from_compiled"])


def skip_hook_frames() -> None:
    """Dynamo inlines the hooks into the frames it traces, but never compiles one as a frame
    of its own (where it runs at a graph break): that would compile an empty graph per
    argument type, up to the recompile limit, with a warning. (``torch._dynamo.reset()``
    forgets this: each session says it again.)"""
    try:
        from torch._dynamo.eval_frame import skip_code

        for code in _HOOK_CODES:
            skip_code(code)
    except Exception:  # noqa: BLE001 (another torch: only slower, and warnings)
        pass


def compiled_parts(model: nn.Module) -> list[str]:
    """What of ``model`` is compiled: the model itself (``torch.compile(model)``), a module's
    ``forward`` replaced by a compiled function, or ``module.compile()`` in place."""
    found = []
    for name, module in model.named_modules():
        label = name or type(model).__name__
        if hasattr(module, "_orig_mod") and hasattr(module, "dynamo_ctx"):
            found.append(f"{label} (torch.compile)")
        elif hasattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable"):
            found.append(f"{label}.forward (torch.compile)")
        elif getattr(module, "_compiled_call_impl", None) is not None:
            found.append(f"{label} (.compile())")
    return found


def frames_compiled() -> int:
    """Frames dynamo has compiled in this process (0 when torch.compile was never used)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    if dynamo is None:
        return 0
    try:
        return int(dynamo.counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 (a torch without these counters)
        return 0


def hooks_compiled_out() -> bool:
    """A hook was compiled out of a fullgraph=True graph in this process."""
    return bool(_state["compiled_out"])


def eager_hint() -> str:
    """How to run the model eagerly; in a vLLM process, vLLM's own switch first."""
    if "vllm" in sys.modules:
        return ("run vLLM eagerly: LLM(..., enforce_eager=True), or vllm serve "
                "--enforce-eager (srdd-dump --eager also turns its compilation off)")
    return EAGER_HINT


class Silence(NamedTuple):
    """Why a session captured nothing."""

    why: str  # in one line
    # the model ran and none of its blocks did, with no compiled code to explain it: when the
    # program then failed, its own error is the likelier cause
    blocks_unseen: bool = False


def explain_silence(model: nn.Module, model_calls: int, block_calls: int) -> Silence | None:
    """Why a session captured nothing; None when its blocks ran (only calls of one token were
    seen) or nothing says the model ran at all."""
    if block_calls:
        return None
    compiled = compiled_parts(model)
    if _state["compiled_out"]:
        return Silence(_compiled_out_silence())
    if compiled or frames_compiled():
        where = f" ({', '.join(compiled[:2])})" if compiled else ""
        return Silence(f"no block hook ever fired: the blocks run as torch.compile'd code"
                       f"{where} compiled before the hooks were registered, where hooks cannot "
                       f"be seen; {LATE_HINT}")
    if model_calls:
        return Silence(f"the model ran {model_calls} time{'s' if model_calls > 1 else ''} but "
                       f"none of its blocks did (name them with {option('layers')})",
                       blocks_unseen=True)
    return None


def explain_partial(silent: list[str], total: int) -> str | None:
    """Why some sites have no records, in one line, when compiled code explains it."""
    if not silent or not frames_compiled():
        return None
    if _state["compiled_out"]:
        why, hint = "compiled out of a fullgraph=True graph", eager_hint()
    else:
        why, hint = "in torch.compile'd code compiled before the hooks were registered", LATE_HINT
    return (f"the hooks of {len(silent)} of {total} capture sites never ran ({silent[0]}"
            f"{', ...' if len(silent) > 1 else ''}): {why}, so the dump has no records of "
            f"them; {hint}")
