"""Probes whose healthy answer is known exactly (docs/method.md, "Exact identities").

* scale: a linear map (nn.Linear, Conv1D) with its bias scaled alike gives
  ``y(2^k x; 2^k b) = 2^k y(x; b)`` bit for bit: multiplying by a power of two is exact and
  commutes with every rounding of the dot products. A clamp, a flush-to-zero, a quantiser with
  a fixed scale or a fixed offset breaks it, each with its own element pattern.
* causality: perturbing the tokens at and after a cut leaves the earlier rows of a causal
  attention (and of a block around it) bit-identical (``probes.perturbed_inputs`` adds that copy).
"""

from __future__ import annotations

import torch
from torch import nn

# k of 2^k. Positive only: x * 2^-k is not exact for subnormal inputs (common in fp16). A fixed
# limit L shows in the windows [L/2, L) (k = 1) and [L/8, L) (k = 3).
SCALE_POWERS = (1, 3)


DECODER_ATTENTION = "decoder"  # vLLM's AttentionType.DECODER (a str enum): causal attention


def is_causal(module: nn.Module) -> bool:
    """An attention (or a block holding one) that declares itself causal: ``is_causal`` (HF)
    or a decoder ``attn_type`` (vLLM's attention layer)."""
    return any(getattr(m, "is_causal", None) is True
               or getattr(m, "attn_type", None) == DECODER_ATTENTION for m in module.modules())


def scale_replays(module: nn.Module, x: torch.Tensor, powers=SCALE_POWERS
                  ) -> list[tuple[int, torch.Tensor]]:
    """[(k, y(2^k x) * 2^-k)] with k = 0 first (the reference, same shape and call), the bias
    scaled alike without touching the module (``torch.func.functional_call``). Subnormal
    input elements are set to 0 in every call (a device that flushes them then computes the
    same thing); rows whose input does not scale exactly (overflow) come back as NaN: not
    judged."""
    bias = getattr(module, "bias", None)
    if x.is_floating_point():  # subnormal inputs: a device may flush them, and 2^k x would not
        x = torch.where(x.abs() < torch.finfo(x.dtype).tiny, torch.zeros_like(x), x)
    out = []
    for k in (0, *powers):
        scale = 2.0 ** k
        xk = x * scale
        exact = ((xk * (1.0 / scale) == x) & torch.isfinite(xk)).all(dim=-1, keepdim=True)
        if isinstance(bias, torch.Tensor) and k:
            y = torch.func.functional_call(module, {"bias": bias * scale}, (xk,))
        else:
            y = module(xk)
        if isinstance(y, (tuple, list)):
            y = y[0]
        if k:
            y = torch.where(exact, y * (1.0 / scale), torch.full_like(y, float("nan")))
        out.append((k, y))
    return out


def causal_cut(seq: int, seed: int) -> int | None:
    """The first perturbed position of a causality probe: seeded, in the middle half."""
    if seq < 2:
        return None
    lo = max(1, seq // 4)
    return lo + seed % max(1, seq - 2 * lo + 1)
