"""Float64 host copies of linear weights, kept for the references of later rounds while their
total stays within a budget (a small model's weights); beyond it each call converts again."""

from __future__ import annotations

import torch
from torch import nn

from .host import HOST

F64 = torch.float64
BUDGET_BYTES = 2 << 30


class HostWeights:
    """(weight, bias) of a Linear module in float64 on the host, cached within a budget."""

    def __init__(self, budget: int = BUDGET_BYTES):
        self.budget, self.used = budget, 0
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def get(self, module: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        found = self._kept.get(id(module))
        if found is not None:
            return found
        weight = module.weight.detach().to(HOST, F64)
        bias = None if module.bias is None else module.bias.detach().to(HOST, F64)
        size = weight.numel() * 8
        if self.used + size <= self.budget:
            self._kept[id(module)] = (weight, bias)
            self.used += size
        return weight, bias

    def linear(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``module`` applied to float64 host rows ``x`` in float64."""
        weight, bias = self.get(module)
        y = x @ weight.T
        return y if bias is None else y + bias
