"""Token rows of captured tensors: the kept positions and rows of a hidden state, copied to
the host in its storage dtype."""

from __future__ import annotations

import numpy as np
import torch

_TORCH_TO_LOGICAL = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}


def kept(
    t: torch.Tensor, positions: torch.Tensor | None, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """(batch, ntok, width) view of the kept token positions; with ``rows``, (1, rows, width)
    of those rows of the flattened (batch * ntok, width) tensor."""
    t = t.detach()
    if t.dim() == 2:
        t = t.unsqueeze(0)
    elif t.dim() != 3:
        t = t.reshape(t.shape[0], -1, t.shape[-1])
    if positions is not None:
        t = t.index_select(-2, positions.to(t.device))
    if rows is not None:
        t = t.reshape(-1, t.shape[-1]).index_select(0, rows.to(t.device)).unsqueeze(0)
    return t


def to_host(
    t: torch.Tensor, positions: torch.Tensor | None, rows: torch.Tensor | None = None
) -> tuple[np.ndarray, str]:
    """Copy the kept part of a hidden state to a numpy array in storage dtype. Always a copy:
    the user's tensor may be changed in place later."""
    t = kept(t, positions, rows)
    logical = _TORCH_TO_LOGICAL.get(t.dtype)
    if logical is None:
        t, logical = t.float(), "float32"
    host = t.to("cpu", copy=True)
    if logical == "bfloat16":
        return host.view(torch.int16).numpy().view(np.uint16), logical
    return host.numpy(), logical
