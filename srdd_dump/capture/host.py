"""Host float64 replay (``--reference host``): one module re-run on the host CPU in float64 from
the input it was just given and its own weights, as a reference that needs no second device.

The copy holds float64 CPU copies of the module's parameters and floating buffers only (one
module at a time, freed after the call) and none of its hooks: an injected fault, like a
faulty device kernel, is not in the reference.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from .probes import FrozenCache, is_cache, module_output, replay_arguments

HOST = torch.device("cpu")
# instance attributes that wrap a module's forward (accelerate's device_map / offload hooks)
WRAPPERS = ("_hf_hook", "_old_forward", "forward")
HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
               "_backward_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


# why a module's weights cannot be copied: an empty weight tensor in the module
HELD_ELSEWHERE = ("projections whose weights are kept elsewhere (an empty weight tensor: the "
                  "engine's own packed form, e.g. vLLM's CPU backend, or a partitioned "
                  "parameter)")


def weight_held_elsewhere(module: nn.Module) -> bool:
    """The module's floating weight is an empty tensor: vLLM's CPU backend hands its Linear
    weights to oneDNN, ZeRO-3 / FSDP keep a parameter's shards on other ranks."""
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.is_floating_point() and w.numel() == 0


def host_copy(module: nn.Module) -> nn.Module:
    """A float64 CPU copy of ``module`` without hooks; the original is not touched."""
    memo: dict[int, Any] = {}
    for m in module.modules():
        if weight_held_elsewhere(m):
            raise RuntimeError(f"{type(m).__name__}: {HELD_ELSEWHERE}: none to copy to the host")
        for p in m._parameters.values():
            if p is not None and id(p) not in memo:
                data = p.detach().to(HOST, torch.float64 if p.is_floating_point() else p.dtype,
                                     copy=True)
                memo[id(p)] = nn.Parameter(data, requires_grad=False)
        for b in m._buffers.values():
            if b is not None and id(b) not in memo:
                memo[id(b)] = b.detach().to(HOST, torch.float64 if b.is_floating_point()
                                            else b.dtype, copy=True)
        for attr in WRAPPERS:  # accelerate's device hooks would move the copy's inputs back
            value = m.__dict__.get(attr)
            if value is not None:
                memo[id(value)] = None
        for attr in HOOK_TABLES:  # hooks are not copied (they hold the capture session)
            table = getattr(m, attr, None)
            if table is not None:
                memo[id(table)] = type(table)()
    clone = copy.deepcopy(module, memo)
    for m in clone.modules():
        for name in WRAPPERS:
            if name in m.__dict__:
                del m.__dict__[name]  # back to the class's own forward
        if hasattr(m, "forward_native") and "_forward_method" in m.__dict__:
            # a serving engine's custom op bound to its device kernel (vLLM's forward_cuda,
            # forward_oot): the host copy runs the op's portable torch code
            m._forward_method = m.forward_native
    return clone


def to_host64(value: Any) -> Any:
    """Floating tensors -> float64 on the host; other tensors -> the host; containers alike."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return value.to(HOST, torch.float64) if value.is_floating_point() else value.to(HOST)
    if isinstance(value, FrozenCache):
        return FrozenCache(value.layer_idx, to_host64(value.keys), to_host64(value.values),
                           value.written)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(to_host64(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(to_host64(v) for v in value)
    if isinstance(value, dict):
        return {k: to_host64(v) for k, v in value.items()}
    return value


def host_replay(module: nn.Module, args: tuple, kwargs: dict,
                cache: FrozenCache | None = None) -> torch.Tensor:
    """The module's hidden-state output (``probes.module_output``) recomputed in float64 on
    the host (autocast off)."""
    args, kwargs = replay_arguments(args, kwargs, cache)
    args = tuple(None if is_cache(a) and not isinstance(a, FrozenCache) else a for a in args)
    clone = host_copy(module)
    try:
        # the host's RNG stream is the user's too: a module drawing random numbers (dropout
        # in training mode) must not move it
        with torch.no_grad(), torch.autocast("cpu", enabled=False), \
                torch.random.fork_rng(devices=[]):
            out = clone(*to_host64(args), **to_host64(kwargs))
    finally:
        del clone
    out = module_output(module, out)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{type(module).__name__} returned no tensor on the host replay")
    return out
