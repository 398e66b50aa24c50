"""Serving-engine calling conventions (vLLM, SGLang, vLLM-Ascend), found by parameter name.

A serving block is called ``block(positions, hidden_states, residual)`` and returns
``(hidden_states, residual)``: the residual stream it represents is their sum (``residual`` is
None on the first block; the model's final norm adds the last pair). Capture records that sum
as the block's output and as the stack's input, and the probes perturb it by adding the
perturbation to ``residual`` (to ``hidden_states`` on the first block), so the replay takes the
code path the call took.

Two things such engines do that a replay must respect:

* a fused add + norm kernel overwrites its input tensors while it runs (vLLM's CUDA
  ``fused_add_rms_norm``), and with them the block's, so the inputs of a module that takes
  ``residual`` are copied before it runs, and every replay gets copies of its own;
* a module that takes ``positions`` reads the batch's layout from the engine's forward context
  and writes the KV cache of those positions in place, so it is replayed with exactly the
  recorded shapes (never a stacked batch) and the last replay is an unperturbed one, which
  writes back what the recorded call wrote.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

HIDDEN = "hidden_states"
RESIDUAL = "residual"
QUERY, KEY = "query", "key"
POSITIONS = "positions"

_SIGNATURES: dict[Any, inspect.Signature | None] = {}


def signature(module: nn.Module) -> inspect.Signature | None:
    """The signature of the module's forward (None when it has none to read); a forward of
    (*args, **kwargs) dispatching to a device's implementation (vLLM's CustomOp:
    forward_native, forward_cpu, forward_cuda, ... share the parameters) is read through its
    forward_native. Looked up once per (class, forward): replays ask on every call."""
    forward = getattr(module, "forward", None)
    key = (type(module), getattr(forward, "__func__", forward))
    if key not in _SIGNATURES:
        _SIGNATURES[key] = _read_signature(forward)
        params = _SIGNATURES[key].parameters.values() if _SIGNATURES[key] else ()
        native = getattr(module, "forward_native", None)
        if params and native is not None and all(
                p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            _SIGNATURES[key] = _read_signature(native) or _SIGNATURES[key]
    return _SIGNATURES[key]


def _read_signature(function: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None


def takes(module: nn.Module, name: str) -> bool:
    sig = signature(module)
    return sig is not None and name in sig.parameters


def is_serving_block(module: nn.Module) -> bool:
    """A block of the (hidden_states, residual) convention, by its forward's parameters."""
    return takes(module, HIDDEN) and takes(module, RESIDUAL)


def replays_alone(module: nn.Module) -> bool:
    """The module takes the batch's token positions (a serving engine's block or attention)."""
    return takes(module, POSITIONS)


def _bound(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    sig = signature(module)
    if sig is None:
        return None
    try:
        return dict(sig.bind_partial(*args, **kwargs).arguments)
    except TypeError:
        return None


def named_input(module: nn.Module, args: tuple, kwargs: dict, name: str = HIDDEN
                ) -> tuple[torch.Tensor | None, Callable[[Any], tuple[tuple, dict]]]:
    """The tensor passed as parameter ``name`` and a function rebuilding the call with another
    value there; (None, ...) when the forward has no such parameter or it holds no tensor."""
    sig = signature(module)
    index = _plain_index(sig, name)
    if index is not None:  # the call succeeded: no binding needed to find the argument
        found = kwargs.get(name) if name in kwargs else (
            args[index] if index < len(args) else None)
    else:
        bound = _bound(module, args, kwargs)
        found = None if bound is None else bound.get(name)
        index = list(sig.parameters).index(name) if found is not None else None
    if not isinstance(found, torch.Tensor):
        return None, lambda value: (args, kwargs)
    if name not in kwargs and index < len(args):
        return found, lambda value: ((*args[:index], value, *args[index + 1:]), kwargs)
    return found, lambda value: (args, {**kwargs, name: value})


_PLAIN: dict[tuple[int, str], int | None] = {}


def _plain_index(sig: inspect.Signature | None, name: str) -> int | None:
    """The position of parameter ``name`` when every parameter up to it is an ordinary one
    (positional or keyword): its argument is then ``args[index]`` or ``kwargs[name]``."""
    key = (id(sig), name)
    if key not in _PLAIN:
        params = list(sig.parameters.values()) if sig is not None else []
        names = [p.name for p in params]
        plain = name in names and all(
            p.kind == p.POSITIONAL_OR_KEYWORD for p in params[: names.index(name) + 1])
        _PLAIN[key] = names.index(name) if plain else None
    return _PLAIN[key]


def stream_input(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """hidden_states + residual of a serving block's call (hidden_states when residual is
    None); None when the call does not have that shape."""
    bound = _bound(module, args, kwargs)
    if bound is None:
        return None
    hidden, residual = bound.get(HIDDEN), bound.get(RESIDUAL)
    if not isinstance(hidden, torch.Tensor):
        return None
    if isinstance(residual, torch.Tensor) and residual.shape == hidden.shape:
        return hidden + residual
    return hidden if residual is None else None


def stream_output(module: nn.Module, output: Any) -> torch.Tensor | None:
    """hidden_states + residual of a serving block's output; None for any other output."""
    if not (isinstance(output, (tuple, list)) and len(output) == 2):
        return None
    hidden, residual = output
    if not (isinstance(hidden, torch.Tensor) and isinstance(residual, torch.Tensor)
            and hidden.shape == residual.shape and is_serving_block(module)):
        return None
    return hidden + residual


def fuses_residual(module: nn.Module) -> bool:
    """A serving block, or a fused add + norm ``norm(x, residual)``: either may overwrite its
    input tensors while it runs."""
    return takes(module, RESIDUAL)


def rotates_in_place(module: nn.Module) -> bool:
    """A rotary embedding of (positions, query, key): a serving engine's, which may rotate
    query and key in place (vLLM's CPU and CUDA kernels do)."""
    return takes(module, QUERY) and takes(module, KEY)


def overwrites_inputs(module: nn.Module) -> bool:
    """A module that may write into its input tensors while it runs: its inputs are copied
    before it runs, and each replay gets copies of its own (frozen_call)."""
    return fuses_residual(module) or rotates_in_place(module)


def frozen_call(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with copies of the inputs it may overwrite: of every floating-point tensor
    for an in-place rotary embedding; else of its hidden-state input (``hidden_states``, else
    the first floating-point positional tensor) and of ``residual``. Taken before such a
    module runs, and for each of its replays."""
    if rotates_in_place(module):
        def copy(value: Any) -> Any:
            floating = isinstance(value, torch.Tensor) and value.is_floating_point()
            return value.detach().clone() if floating else value

        return tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}
    hidden, rebuild = named_input(module, args, kwargs, HIDDEN)
    if hidden is not None:
        args, kwargs = rebuild(hidden.detach().clone())
    else:
        index = next((i for i, a in enumerate(args)
                      if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        if index is not None:
            args = (*args[:index], args[index].detach().clone(), *args[index + 1:])
    residual, rebuild = named_input(module, args, kwargs, RESIDUAL)
    if residual is not None:
        args, kwargs = rebuild(residual.detach().clone())
    return args, kwargs


def stream_perturbation(module: nn.Module, args: tuple, kwargs: dict
                        ) -> tuple[torch.Tensor | None, Callable[[torch.Tensor], tuple]]:
    """(the input stream x, rebuild): ``rebuild(x + d)`` is the call with ``d`` added to
    residual (with hidden_states replaced by x + d when residual is None); ``rebuild(x)`` is
    the recorded call itself."""
    x = stream_input(module, args, kwargs)
    if x is None:
        return None, lambda value: (args, kwargs)
    hidden, set_hidden = named_input(module, args, kwargs, HIDDEN)
    residual, _ = named_input(module, args, kwargs, RESIDUAL)

    def rebuild(xp: torch.Tensor) -> tuple[tuple, dict]:
        if residual is None or xp is x:
            return set_hidden(xp) if residual is None else (args, kwargs)
        _, set_residual = named_input(module, args, kwargs, RESIDUAL)
        return set_residual(_moved(residual, x, xp))

    return x, rebuild


def _moved(residual: torch.Tensor, stream: torch.Tensor, xp: torch.Tensor) -> torch.Tensor:
    """``residual`` carrying the stream's change ``xp - stream`` (in float32), in its dtype."""
    return (residual.float() + (xp.float() - stream.float())).to(residual.dtype)


def fused_add_perturbation(args: tuple, kwargs: dict
                           ) -> tuple[torch.Tensor | None, Callable[[torch.Tensor], tuple]]:
    """A fused add + norm called as ``norm(x, residual=r)`` normalises the stream x + r: (that
    stream, rebuild), where ``rebuild(s + d)`` is the call with ``d`` added to ``r`` (x as it
    was: the kernel adds them as on the device) and ``rebuild(stream)`` the call itself.
    Perturbing x alone would move a row whose stream is dominated by the residual (a massive
    activation of the first token) by a fraction of its size, reading as values that do not
    move (a clip)."""
    x = args[0] if args else None
    residual = kwargs.get(RESIDUAL)
    if not (isinstance(x, torch.Tensor) and isinstance(residual, torch.Tensor)
            and x.is_floating_point() and residual.shape == x.shape):
        return None, lambda value: (args, kwargs)
    stream = (x.float() + residual.float()).to(x.dtype)

    def rebuild(xp: torch.Tensor) -> tuple[tuple, dict]:
        if xp is stream:
            return args, kwargs
        if xp.dim() == x.dim() + 1:  # copies stacked on a new leading dimension
            xs, rs, st = (t.unsqueeze(0).expand_as(xp) for t in (x, residual, stream))
        elif xp.shape[0] != x.shape[0]:  # copies along the batch
            k = xp.shape[0] // x.shape[0]
            xs, rs, st = (torch.cat([t] * k) for t in (x, residual, stream))
        else:
            xs, rs, st = x, residual, stream
        return (xs.contiguous(), *args[1:]), {**kwargs, RESIDUAL: _moved(rs, st, xp).contiguous()}

    return stream, rebuild
