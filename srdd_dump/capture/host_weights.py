"""Float64 host copies of linear weights for the references: kept for later rounds while their
total stays within a budget (a small model's weights); beyond it each call copies the weight off
the device in its own format and converts it into one reused float64 buffer (a fresh float64
allocation costs 5x the conversion: its pages are faulted in and zeroed on every call, and a 7B
layer converts 1.9 GB per probed round)."""

from __future__ import annotations

import torch
from torch import nn

from .host import HOST

F64 = torch.float64
BUDGET_BYTES = 2 << 30


class HostWeights:
    """Linear modules applied in float64 on the host, their weights cached within a budget."""

    def __init__(self, budget: int | None = None):
        self.budget, self.used = BUDGET_BYTES if budget is None else budget, 0
        # id(module) -> (float64 weight, float64 bias, what they were converted from)
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor | None, tuple]] = {}
        self._scratch: dict[torch.dtype, torch.Tensor] = {}  # float64 weights, reused
        self._staged: dict[torch.dtype, torch.Tensor] = {}  # device weights copied as they are

    def linear(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``module`` applied to float64 host rows ``x`` in float64."""
        weight, bias = self._weights(module)
        y = x @ weight.T  # a new tensor: the scratch buffer may be reused by the next call
        return y if bias is None else y + bias

    def release(self) -> None:
        """Drop the kept weights and the reused buffers (the session is closed)."""
        self._kept.clear()
        self._scratch.clear()
        self._staged.clear()
        self.used = 0

    def _weights(self, module: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        found = self._kept.get(id(module))
        if found is not None:
            if found[2] == _state(module):
                return found[0], found[1]
            # changed since (a training step, new weights loaded): converted again
            del self._kept[id(module)]
            self.used -= found[0].numel() * 8
        source = module.weight.detach()
        bias = None if module.bias is None else module.bias.detach().to(HOST, F64)
        size = source.numel() * 8
        if type(source) is not torch.Tensor:  # a tensor subclass (DTensor, quantised): its own
            return source.to(HOST, F64), bias  # conversion, never kept
        if self.used + size <= self.budget:
            weight = source.to(HOST, F64)
            self._kept[id(module)] = (weight, bias, _state(module))
            self.used += size
            return weight, bias
        if source.device != HOST:  # off the card in its own format: a quarter of the bytes
            source = _into(self._staged, source).copy_(source)
        weight = _into(self._scratch, source, F64)
        weight.copy_(source)  # exact: every float format converts to float64 without rounding
        return weight, bias


SAMPLED = 256  # values of a weight compared to tell a change made through ``.data``


def _state(module: nn.Linear) -> tuple:
    """What a kept conversion was made from: the parameter objects, their storage and a few of
    their values (an optimizer step, ``load_state_dict`` or ``p.data.copy_(...)`` change
    values in place; ``p.data = t`` changes the storage)."""
    out = []
    for p in (module.weight, module.bias):
        if p is None:
            out.append(None)
            continue
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLED)][:SAMPLED].to("cpu", copy=True)
        out.append((id(p), p.data_ptr(),
                    sample.contiguous().view(torch.uint8).numpy().tobytes()))
    return tuple(out)


def _into(buffers: dict, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor of ``like``'s shape in ``dtype`` (default: its own), a view of the reused
    buffer of that dtype (grown to the largest size asked)."""
    dtype = dtype or like.dtype
    n = like.numel()
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < n:
        buffer = buffers[dtype] = torch.empty(n, dtype=dtype, device=HOST)
    return buffer[:n].view(like.shape)
