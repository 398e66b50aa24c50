"""Fused mixture-of-experts modules: what a call routed, each routed expert's own output, and
routing held fixed while a block is replayed.

A fused experts module (transformers 5's Mixtral / Qwen-MoE / DeepSeek ``experts``, a serving
engine's fused MoE kernel behind the same signature) is called as
``experts(hidden (T, H), top_k_index (T, k), top_k_weights (T, k))`` and returns the weighted
sum of the k routed experts of every token: there is no module per expert to hook. Each
expert's own output is recovered by calling the same module (the device's own kernel) with
one routing slot at a time and unit weight: token t's slot j gives y_{e_tj}(x_t). An index
out of range (an expert-parallel "not on this rank" slot) gives zeros and is never read.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn

from .probes import this_thread
from .serving import signature


class Routing(NamedTuple):
    index: torch.Tensor  # (T, k) expert of each token slot
    weights: torch.Tensor  # (T, k) its weight in the sum


def routing_of(args: tuple, kwargs: dict) -> tuple[torch.Tensor, Routing] | None:
    """(hidden, routing) of a fused experts call: the hidden states, then the first integer
    tensor (the top-k index) and the next floating tensor (the top-k weights)."""
    values = [*args, *kwargs.values()]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if len(tensors) < 3 or not tensors[0].is_floating_point():
        return None
    hidden = tensors[0]
    index = next((t for t in tensors[1:] if not t.is_floating_point()), None)
    weights = next((t for t in tensors[1:] if t.is_floating_point()), None)
    if index is None or weights is None or index.dim() != 2 or index.shape != weights.shape:
        return None
    if hidden.dim() != 2 or hidden.shape[0] != index.shape[0]:
        return None
    return hidden, Routing(index, weights)


def _names(experts: nn.Module) -> tuple[str, str, str] | None:
    """(hidden, index, weights) parameter names of a fused experts forward (its signature read
    once: serving.signature caches it)."""
    sig = signature(experts)
    if sig is None:
        return None
    params = list(sig.parameters)
    index = next((p for p in params[1:] if "index" in p or "indices" in p), None)
    weights = next((p for p in params[1:] if "weight" in p), None)
    return (params[0], index, weights) if index and weights else None


def call_experts(experts: nn.Module, hidden: torch.Tensor, index: torch.Tensor,
                 weights: torch.Tensor, hooks: bool = True) -> torch.Tensor:
    """A fused experts module called with its arguments by name, whatever their order
    (positionally (hidden, index, weights) when the names are not found); ``hooks=False``
    calls its forward alone."""
    call = experts if hooks else experts.forward
    names = _names(experts)
    if names is None:
        return call(hidden, index, weights)
    return call(**{names[0]: hidden, names[1]: index, names[2]: weights})


def slot_outputs(experts: nn.Module, hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(..., T, k * H): every token slot's expert output on ``hidden`` (..., T, H), unweighted.
    Leading dimensions (stacked probe copies) are folded into the token dimension."""
    lead = hidden.shape[:-2]
    tokens, width = hidden.shape[-2], hidden.shape[-1]
    k = index.shape[-1]
    copies = hidden.numel() // max(1, tokens * width)
    flat = hidden.reshape(copies * tokens, width)
    slots = index.repeat(copies, 1).reshape(-1, 1)
    ones = torch.ones(slots.shape, dtype=hidden.dtype, device=hidden.device)
    out = call_experts(experts, flat.repeat_interleave(k, dim=0), slots, ones)
    return out.reshape(*lead, tokens, k * width)


def topk_margin(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(T,) per token, the router's softmax probability of the least likely expert it was sent
    to minus that of the most likely one it was not (analysis.experts.topk_margin): how close
    it came to another routing. Negative when the router chose by another score (a score
    correction bias, a group limit: DeepSeek)."""
    p = torch.softmax(logits.detach().float().reshape(-1, logits.shape[-1]), dim=-1)
    chosen = torch.zeros_like(p, dtype=torch.bool)
    index = index.to(p.device).long()
    ok = (index >= 0) & (index < p.shape[-1])
    chosen.scatter_(1, torch.where(ok, index, 0), ok)
    if bool(chosen.all(dim=1).any()):
        return torch.full(p.shape[:1], float("nan"), device=p.device)
    low = torch.where(chosen, p, torch.ones_like(p)).amin(dim=1)
    high = torch.where(chosen, torch.zeros_like(p), p).amax(dim=1)
    return low - high


def bias_free(experts: nn.Module) -> bool:
    """Every parameter is a 3-D expert weight: an expert's output for a zero input is 0."""
    params = list(experts.parameters())
    return bool(params) and all(p.dim() == 3 for p in params)


class SlotReplay(nn.Module):
    """A module whose output is ``slot_outputs`` of fixed routing rows: the probes replay it
    like any row-wise operator (its input rows perturbed, the routing never re-decided)."""

    def __init__(self, experts: nn.Module, index: torch.Tensor):
        super().__init__()
        self.experts = experts
        self.index = index

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return slot_outputs(self.experts, hidden, self.index)


def expert_rows(slots: torch.Tensor, index: torch.Tensor, expert: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows (T, H), routed (T,) bool): expert ``expert``'s output on the tokens routed to it
    (zeros elsewhere) from slot outputs (T, k * H) and their index (T, k)."""
    tokens, k = index.shape
    hit = index == expert
    routed = hit.any(dim=1)
    slot = hit.to(torch.int8).argmax(dim=1)
    per_slot = slots.reshape(tokens, k, -1)
    rows = per_slot.gather(1, slot.view(-1, 1, 1).expand(-1, 1, per_slot.shape[-1])).squeeze(1)
    return torch.where(routed.unsqueeze(1), rows, torch.zeros_like(rows)), routed


@contextmanager
def pinned_routing(modules: list[nn.Module], recorded: dict[int, Routing]) -> Iterator[None]:
    """While a block or sub-block is replayed on perturbed copies of its input, every fused
    experts call inside takes the routing recorded for its tokens (tiled over the copies), so
    a perturbation that would flip a token to another expert never reads as a fault of the
    module. Calls of another number of tokens are left alone."""

    replaying = this_thread()

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if not replaying():  # the program's own call, in another thread
            return None
        routing = recorded.get(id(module))
        found = routing_of(args, kwargs)
        if routing is None or found is None:
            return None
        hidden, now = found
        tokens = routing.index.shape[0]
        if tokens == 0 or hidden.shape[0] % tokens:
            return None
        copies = hidden.shape[0] // tokens
        swap = {id(now.index): routing.index.repeat(copies, 1),
                id(now.weights): routing.weights.repeat(copies, 1)}
        # the same call, by position and name, with only the routing tensors replaced
        return (tuple(swap.get(id(a), a) for a in args),
                {k: swap.get(id(v), v) for k, v in kwargs.items()})

    handles = [m.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True)
               for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
