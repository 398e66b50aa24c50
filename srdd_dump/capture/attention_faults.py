"""Faults inside the attention kernel, for the simulator (``--inject``): the porting bugs of a
fused attention kernel, planted in one layer's attention computation of a Hugging Face model.

==================  ========================================================================
softmax_precision   softmax computed in ``dtype=bfloat16`` (or float16) and cast back
double_scale        the 1/sqrt(d) scaling applied twice (scores * scale^2)
rotary_offset       the new tokens' queries and keys rotated ``shift=1`` positions too far
                    (with ``phase=decode``: the decode kernel's rotary off by one)
mask_shift          each query row misses the newest key it may read (the causal diagonal off
                    by one; decode steps only: at a prefill the first row would read nothing)
gqa_mapping         query head h reads KV head ``h % kv_heads`` instead of ``h // group``
==================  ========================================================================

The layer's attention module gets a config of its own naming an attention implementation
registered for it (transformers' ``ALL_ATTENTION_FUNCTIONS``), which computes the attention
eagerly with the fault and hands every call the fault does not apply to (another phase) to
the model's own implementation. The other layers are untouched; ``remove`` restores the config.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from ..errors import UserError
from .faultspec import FaultSpec
from .option_names import option

ATTENTION_FAULTS = ("softmax_precision", "double_scale", "rotary_offset", "mask_shift",
                    "gqa_mapping")


def _registry():
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return None
    return ALL_ATTENTION_FUNCTIONS


def _rotate(x: torch.Tensor, inv_freq: torch.Tensor, shift: float) -> torch.Tensor:
    """x (..., head_dim) rotated by ``shift`` more positions (rotate-half layout)."""
    freqs = shift * inv_freq.to(device=x.device, dtype=torch.float32)
    emb = torch.cat([freqs, freqs])
    width = emb.numel()
    part, rest = x[..., :width].float(), x[..., width:]
    half = width // 2
    turned = torch.cat([-part[..., half:], part[..., :half]], dim=-1)
    return torch.cat([(part * emb.cos() + turned * emb.sin()).to(x.dtype), rest], dim=-1)


class AttentionKernelFault:
    """One planted attention-kernel fault (the table above)."""

    def __init__(self, spec: FaultSpec, module: nn.Module, inv_freq: torch.Tensor | None):
        registry = _registry()
        config = getattr(module, "config", None)
        if registry is None or config is None or not hasattr(config, "_attn_implementation"):
            raise UserError(f"{option('inject')} {spec.type}: needs a Hugging Face attention "
                            "module (one with a config naming its attention implementation)")
        if spec.type == "rotary_offset" and inv_freq is None:
            raise UserError(f"{option('inject')} rotary_offset: the model has no rotary "
                            "embedding table")
        self.spec, self.module, self.inv_freq = spec, module, inv_freq
        self.phase = spec.options.get("phase", "decode" if spec.type == "mask_shift" else "all")
        self.softmax_dtype = getattr(torch, spec.options.get("dtype", "bfloat16"))
        # asked once, eagerly: a compiled graph would trace a try/except's first branch
        param = next(module.parameters(), None)
        self.softmax_native = _softmax_runs(self.softmax_dtype,
                                            param.device if param is not None else "cpu")
        self.shift = float(spec.options.get("shift", 1))
        self.original_config = config
        implementation = config._attn_implementation or "eager"
        self.original: Callable | None = (None if implementation == "eager"
                                          else registry[implementation])
        self.name = f"srdd_fault_{spec.type}_{id(module)}"
        registry[self.name] = self
        mine = copy.copy(config)
        mine._attn_implementation = self.name
        module.config = mine

    def remove(self) -> None:
        self.module.config = self.original_config
        registry = _registry()
        if registry is not None:
            try:
                del registry[self.name]
            except (KeyError, TypeError, AttributeError):  # a registry without deletion
                pass

    def _applies(self, query: torch.Tensor) -> bool:
        if self.phase == "all":
            return True
        return (query.shape[-2] == 1) == (self.phase == "decode")

    def __call__(self, module: nn.Module, query, key, value, attention_mask, scaling=None,
                 dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, Any]:
        if not self._applies(query):
            if self.original is not None:
                return self.original(module, query, key, value, attention_mask,
                                     scaling=scaling, dropout=dropout, **kwargs)
            return self._eager(query, key, value, attention_mask, scaling, clean=True)
        return self._eager(query, key, value, attention_mask, scaling, clean=False)

    def _eager(self, query, key, value, mask, scaling, clean: bool):
        kind = "" if clean else self.spec.type
        heads, kv_heads = query.shape[1], key.shape[1]
        index = torch.arange(heads, device=key.device)
        index = index % kv_heads if kind == "gqa_mapping" else index // (heads // kv_heads)
        key, value = key[:, index], value[:, index]
        q_len, k_len = query.shape[-2], key.shape[-2]
        if kind == "rotary_offset":
            query = _rotate(query, self.inv_freq, self.shift)
            key = torch.cat([key[..., :k_len - q_len, :],
                             _rotate(key[..., k_len - q_len:, :], self.inv_freq, self.shift)],
                            dim=-2)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if kind == "double_scale":
            scale = scale * scale
        scores = torch.matmul(query, key.transpose(-1, -2)) * scale
        # masked scores at the dtype's lowest value, as transformers' eager attention: a row
        # with nothing to read (padding) stays finite
        lowest = torch.finfo(scores.dtype).min
        if mask is None:
            allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(
                k_len - q_len)
            scores = scores.masked_fill(~allowed, lowest)
        elif mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask[..., :k_len], lowest)
        else:
            scores = scores + mask[..., :k_len]
        if kind == "mask_shift":  # each row's newest key (its own)
            rows = torch.arange(q_len, device=scores.device)
            scores[..., rows, k_len - q_len + rows] = lowest
        dtype = self.softmax_dtype if kind == "softmax_precision" else torch.float32
        # masked scores must stay finite in the softmax's own dtype too (cast first: a bf16
        # tensor cannot hold float32's lowest value)
        scores = scores.to(dtype).clamp(min=torch.finfo(dtype).min)
        if dtype == torch.float32 or self.softmax_native:
            weights = torch.softmax(scores, dim=-1)
        else:  # no kernel in that dtype (torch 2.1's CPU has no float16 softmax): rounded to it
            weights = torch.softmax(scores.float(), dim=-1).to(dtype)
        weights = weights.to(query.dtype)
        out = torch.matmul(weights, value)
        return out.transpose(1, 2).contiguous(), None


def _softmax_runs(dtype: torch.dtype, device) -> bool:
    """The device computes a softmax in ``dtype`` (the planted fault must never stop the
    program it is planted in)."""
    try:
        torch.softmax(torch.zeros(2, dtype=dtype, device=device), dim=-1)
    except RuntimeError:
        return False
    return True
