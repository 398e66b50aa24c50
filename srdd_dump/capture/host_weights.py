"""Float64 host weights for the references: each call copies the weight off the device in its
own format and converts it into one reused float64 buffer. Keeping converted weights for later
rounds costs more than it saves: a fresh float64 tensor's pages are faulted in and zeroed
(SmolLM2's 106M reference weights: 0.33 s once, against 0.02 s per probed round converted into
the warm buffer), and it holds up to 8 bytes per parameter of resident memory."""

from __future__ import annotations

import torch
from torch import nn

from .host import HOST

F64 = torch.float64


class HostWeights:
    """Linear modules applied in float64 on the host."""

    def __init__(self) -> None:
        self._scratch: dict[torch.dtype, torch.Tensor] = {}  # float64 weights, reused
        self._staged: dict[torch.dtype, torch.Tensor] = {}  # device weights copied as they are

    def linear(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``module`` applied to float64 host rows ``x`` in float64."""
        weight = self._weight(module)
        y = x @ weight.T  # a new tensor: the scratch buffer is reused by the next call
        bias = getattr(module, "bias", None)
        return y if bias is None else y + bias.detach().to(HOST, F64)

    def release(self) -> None:
        """Drop the reused buffers (the session is closed)."""
        self._scratch.clear()
        self._staged.clear()

    def _weight(self, module: nn.Linear) -> torch.Tensor:
        source = module.weight.detach()
        if type(source) is not torch.Tensor:  # a tensor subclass (DTensor, quantised): its own
            return source.to(HOST, F64)  # conversion
        if source.device != HOST:  # off the card in its own format: a quarter of the bytes
            source = _into(self._staged, source).copy_(source)
        weight = _into(self._scratch, source, F64)
        weight.copy_(source)  # exact: every float format converts to float64 without rounding
        return weight


def _into(buffers: dict, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor of ``like``'s shape in ``dtype`` (default: its own), a view of the reused
    buffer of that dtype (grown to the largest size asked)."""
    dtype = dtype or like.dtype
    n = like.numel()
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < n:
        # a normal tensor even when made under inference_mode: a later round outside it
        # (an eval pass during fine-tuning) writes into it
        with torch.inference_mode(False):
            buffer = buffers[dtype] = torch.empty(n, dtype=dtype, device=HOST)
    return buffer[:n].view(like.shape)
