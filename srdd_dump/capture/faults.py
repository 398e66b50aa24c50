"""Fault simulator: forward hooks that corrupt one module's output, for calibration and demos.

Spec syntax (``srdd-dump --inject``, repeatable)::

    TYPE@layer=K[,site=block|attn|mlp|MODULE.PATH][,m=0.3][,sparsity=0.1][,seed=0][,key=value]

``layer=K`` is the model's layer K (the block named ``...layers.K``, also when ``--layers``
captures only some blocks); a negative K counts from the last captured block. ``m`` is the
magnitude (default 0.3). ``sparsity`` < 1 restricts the fault to a fixed, seeded
subset of that fraction of hidden channels; the other channels pass through untouched, and
max|h|, std(h) and mean|h| below are taken over the affected channels only. ``h`` below
is the module's output hidden state. Those statistics are taken over the whole output tensor
(``scope=batch``, the default: a per-tensor dynamic range, as a device computes it and as the
first SRDD's formula reads), so one sequence's result depends on the rest of its batch,
including the perturbed copies a batched probe replay adds; ``scope=sample`` takes them per
sequence, so a sequence's output never depends on its batch.

========================  =====================================================================
dead_zone                 h = 0 where |h| < m * max|h|
mxfp4_deadzone            h = 0 where |h| < m * max|h| of its 32-element block (m default 0.01)
saturation                clamp to +-(1 - m) * max|h|  (``mode=absolute,limit=L``: clamp to +-L)
bias                      h + m * std(h)
noise                     h + m * mean|h| * eps, eps ~ N(0, 1) fresh on every call
spike                     with probability m / 100 an element becomes 10 * max|h| * eps
nondeterminism            fresh small noise on every call, ``mode=``
                            amplified:    h * (1 + m/100 * eps)           (relative jitter)
                            inconsistent: h + m/100 * std(h) * eps on half the calls
                            biased:       h + m/100 * std(h) * (eps + 1)
                            correlated:   h + m/100 * std(h) * e_c, one draw per channel
stuck_at                  channels stuck at ``value`` (default m * max|h| of the first call)
bitflip                   each element flips one random bit with probability ``rate``
                          (default 1e-4) in the ``bits=mantissa|exponent`` of its float32 value
precision                 h rounded to ``dtype=bfloat16|float16`` and back
int8                      dynamic 8-bit quantisation and back: h = round(h / s) * s clamped to
                          +-127 steps, s = max|h| / 127 of each token row (``per=tensor``:
                          of the whole output), as a W8A8 kernel's per-token activation scale
scale                     h * (1 + m) (a wrong scale factor; with sparsity: on a few channels)
causal_leak               h_t + m * mean(h_{t+1..}) over the later tokens of the same sequence
                          (an attention mask bug: rows see the future; multi-token calls)
softmax_precision, ...    inside one layer's attention kernel (site=attn): softmax_precision,
                          double_scale, rotary_offset, mask_shift, gqa_mapping
                          (capture/attention_faults.py)
========================  =====================================================================

Element-wise absolute limits, as a device's number format makes them: ``limit=L`` (a value) or
``quantile=Q`` (L = the Q-quantile of |h| on the fault's first call, then fixed) turns
dead_zone into a flush-to-zero (h = 0 where |h| < L), saturation into a clamp at +-L and bias
into a fixed offset h + L. ``phase=decode`` (or ``prefill``) restricts any fault to one-token
calls (or to the others): a bug in the decode kernel only; in a serving engine's flat batch, to
the requests running a decode step (a single row) or the others. ``rank=R`` installs the
fault only in the process whose RANK (else LOCAL_RANK) is R: one faulty card of a
multi-process run. Under
tensor parallelism a fault acts on what the module returns on its rank (a DTensor: its local
tensor, statistics included), so no fault ever communicates.

Mixture of experts: ``site=expert:E`` corrupts expert E of the layer's fused experts module
(one module holding every expert, called as ``experts(hidden, top_k_index, top_k_weights)``):
its own output on the tokens routed to it, before the routing weight, as a faulty expert
kernel would; the other experts' shares of the sum are untouched. ``site=router`` corrupts the
router's logits and re-decides the top-k from them (softmax top-k; the weights normalised
when the model's were), so a router fault changes the routing as it would on a device.

The random streams of faults come from their own seeded generators: they never touch the user's
global RNG. On a serving-engine block (``(hidden_states, residual)``, capture/serving.py) ``h``
is the stream hidden + residual, and the block returns ``(fault(h), 0)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import UserError
from ..format.layer_numbers import layer_numbers, position_of
from ..vocabulary import EXPERT, EXPERTS, ROUTER
from . import serving
from .attention_faults import AttentionKernelFault
from .attention_reference import rotary_of
from .compiled import opaque, opaque_method
from .discovery import find_moe_sites
from .experts import call_experts, routing_of
from .faultspec import ATTENTION_KERNEL, FaultSpec
from .option_names import option
from .parallel import env_rank, map_local
from .requests import BatchLayout, engine_batch

SITE_NAMES = {
    "attn": ("self_attn", "attn", "attention", "self_attention"),
    "mlp": ("mlp", "feed_forward", "ffn"),
}


def fault_site(blocks: list[tuple[str, nn.Module]], model: nn.Module, spec: FaultSpec):
    """(name, module) where the fault sits."""
    name, block = fault_block(blocks, spec)
    if spec.site == "block":
        return name, block
    if spec.site == "router" or spec.site.startswith("expert:"):
        return _moe_site(name, block, spec)
    children = dict(block.named_children())
    for candidate in SITE_NAMES.get(spec.site, ()):
        if candidate in children:
            return f"{name}.{candidate}", children[candidate]
    modules = dict(model.named_modules())
    for path in (spec.site, f"{name}.{spec.site}"):
        if path in modules:
            return path, modules[path]
    raise UserError(f"{option('inject')}: no site {spec.site!r} in {name} (children: "
                    f"{sorted(children)})")


def fault_block(blocks: list[tuple[str, nn.Module]], spec: FaultSpec) -> tuple[str, nn.Module]:
    """The block of ``layer=K``: the block the model numbers K (``model.layers.K``, whichever
    blocks --layers captures), or the K-th from the end for a negative K."""
    numbers = layer_numbers([name for name, _ in blocks])
    position = position_of(numbers, spec.layer)
    if position is not None:
        return blocks[position]
    contiguous = numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    listed = (f"{numbers[0]}-{numbers[-1]}" if contiguous and len(numbers) > 1
              else ", ".join(map(str, numbers)))
    span = f"{blocks[0][0]}" + (f" to {blocks[-1][0]}" if len(blocks) > 1 else "")
    raise UserError(f"{option('inject')}: layer {spec.layer} out of range: the captured blocks "
                    f"are layers {listed} ({span})")


def _moe_site(name: str, block: nn.Module, spec: FaultSpec) -> tuple[str, nn.Module]:
    sites = find_moe_sites([(name, block)])
    role = ROUTER if spec.site == "router" else EXPERTS
    found = next((site for site in sites if site.role == role), None)
    if found is None:
        raise UserError(f"{option('inject')}: {name} has no {role} (site={spec.site} needs a fused "
                        "mixture-of-experts module)")
    if role == EXPERTS:
        count = sum(1 for site in sites if site.role == EXPERT and site.module is found.module)
        expert = spec.site.split(":", 1)[1]
        if not expert.isdigit() or int(expert) >= count:
            raise UserError(f"{option('inject')}: site={spec.site}: expert must be 0..{count - 1}")
    return found.name, found.module


class _Fault:
    """Callable forward hook applying one FaultSpec to the module's first output tensor."""

    def __init__(self, spec: FaultSpec):
        self.spec = spec
        self.gen = torch.Generator().manual_seed(spec.seed + 7919)
        self.calls = 0
        self.channels: torch.Tensor | None = None
        self.stuck_value: float | None = None
        self.limit: float | None = None  # the element-wise absolute limit, once known

    def _noise(self, shape, like: torch.Tensor) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen).to(device=like.device, dtype=torch.float32)

    def _mask(self, width: int, device) -> torch.Tensor | None:
        if self.spec.sparsity >= 1:
            return None
        if self.channels is None:
            gen = torch.Generator().manual_seed(self.spec.seed)
            n = max(1, round(self.spec.sparsity * width))
            self.channels = torch.randperm(width, generator=gen)[:n]
        mask = torch.zeros(width, dtype=torch.bool, device=device)
        mask[self.channels.to(device)] = True
        return mask

    def corrupt(self, h: torch.Tensor) -> torch.Tensor:
        s, o = self.spec, self.spec.options
        x = h.float()
        mask = self._mask(x.shape[-1], x.device)
        # Scales come from the affected channels: a sparse fault acts on its own units' range.
        ref = x if mask is None else x[..., mask]
        amax, std, mean_abs = self._statistics(ref, o.get("scope", "batch"))
        m = s.m
        limit = self._absolute_limit(ref)
        if limit is not None and s.type in ("dead_zone", "saturation", "bias"):
            y = (torch.where(x.abs() < limit, torch.zeros_like(x), x) if s.type == "dead_zone"
                 else x.clamp(-limit, limit) if s.type == "saturation" else x + limit)
        elif s.type == "dead_zone":
            y = torch.where(x.abs() < m * amax, torch.zeros_like(x), x)
        elif s.type == "mxfp4_deadzone":
            width = x.shape[-1]
            pad = (-width) % 32
            blocks = torch.nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], -1, 32)
            bmax = blocks.abs().amax(dim=-1, keepdim=True)
            blocks = torch.where(blocks.abs() < m * bmax, torch.zeros_like(blocks), blocks)
            y = blocks.reshape(*x.shape[:-1], width + pad)[..., :width]
        elif s.type == "saturation":
            y = x.clamp(-(1 - m) * amax, (1 - m) * amax)
        elif s.type == "bias":
            y = x + m * std
        elif s.type == "noise":
            y = x + m * mean_abs * self._noise(x.shape, x)
        elif s.type == "spike":
            u = torch.rand(x.shape, generator=self.gen).to(x.device)
            y = torch.where(u < m / 100, 10 * amax * self._noise(x.shape, x), x)
        elif s.type == "nondeterminism":
            y = self._nondeterminism(x, std, o.get("mode", "amplified"))
        elif s.type == "stuck_at":
            if self.stuck_value is None:
                self.stuck_value = float(o.get("value", m * float(amax.max())))
            y = torch.full_like(x, self.stuck_value)
        elif s.type == "bitflip":
            y = self._bitflip(x, float(o.get("rate", 1e-4)), o.get("bits", "mantissa"))
        elif s.type == "precision":
            y = x.to(getattr(torch, o.get("dtype", "bfloat16"))).float()
        elif s.type == "int8":
            rows = (ref.abs().amax() if o.get("per") == "tensor"
                    else ref.abs().amax(dim=-1, keepdim=True))  # the affected channels' range
            step = torch.where(rows > 0, rows / 127, torch.ones_like(rows))
            y = torch.round(x / step).clamp(-127, 127) * step
        elif s.type == "scale":
            y = x * (1 + m)
        elif s.type == "causal_leak":
            y = x + m * _mean_of_later(x)
        else:  # parse_fault rejects unknown types
            raise AssertionError(s.type)
        if mask is not None:
            y = torch.where(mask, y, x)
        self.calls += 1
        return y.to(h.dtype)

    def _absolute_limit(self, ref: torch.Tensor) -> float | None:
        o = self.spec.options
        if self.limit is None and "limit" in o:
            self.limit = float(o["limit"])
        elif self.limit is None and "quantile" in o:
            flat = ref.detach().abs().flatten().float()
            q = float(o["quantile"])
            self.limit = float(flat.kthvalue(max(1, min(flat.numel(), round(q * flat.numel()))))
                               .values)
        return self.limit

    def applies(self, h: torch.Tensor) -> bool:
        """The fault's phase acts on some row of this call (``phase_rows``)."""
        return self.phase_rows(h) is not False

    def phase_rows(self, h: torch.Tensor) -> bool | torch.Tensor:
        """The rows of ``h`` the fault's phase covers: True every row (phase all, or a call of
        that phase), False none, or a row mask. A call's phase is decode when it runs one token
        per sequence; a serving engine runs the new tokens of every request scheduled as one
        flat batch (tokens, hidden), where a request's single row is its decode step and its
        several rows a prefill (or a chunk of one): the phase is then decided per request."""
        phase = self.spec.options.get("phase", "all")
        if phase == "all":
            return True
        found = engine_rows(h) if h.dim() == 2 else None
        if found is None:
            one_token = h.dim() >= 2 and h.shape[-2] == 1
            return one_token if phase == "decode" else not one_token
        one_row, real = found
        rows = one_row if phase == "decode" else real & ~one_row
        if bool(rows.all()):
            return True
        return torch.from_numpy(rows).to(h.device) if rows.any() else False

    def corrupt_rows(self, h: torch.Tensor, rows: bool | torch.Tensor) -> torch.Tensor:
        """``h`` with the fault on ``rows`` (``phase_rows``), the others as they were."""
        if rows is True:
            return self.corrupt(h)
        if rows is False:
            return h
        out = h.clone()
        out[rows] = self.corrupt(h[rows])
        return out

    @staticmethod
    def _statistics(ref: torch.Tensor, scope: str):
        """max|h|, std(h), mean|h| of each sequence (shaped to broadcast) or of the tensor."""
        if scope == "batch" or ref.dim() < 3:  # a 2-D output holds one sequence
            return ref.abs().max(), ref.std(), ref.abs().mean()
        flat = ref.reshape(ref.shape[0], -1)
        shape = (ref.shape[0],) + (1,) * (ref.dim() - 1)
        return (flat.abs().amax(dim=1).reshape(shape), flat.std(dim=1).reshape(shape),
                flat.abs().mean(dim=1).reshape(shape))

    def _nondeterminism(self, x: torch.Tensor, std: torch.Tensor, mode: str) -> torch.Tensor:
        scale = self.spec.m / 100
        if mode == "amplified":
            return x * (1 + scale * self._noise(x.shape, x))
        if mode == "inconsistent":
            hit = bool(torch.rand((), generator=self.gen) < 0.5)
            return x + scale * std * self._noise(x.shape, x) if hit else x
        if mode == "biased":
            return x + scale * std * (self._noise(x.shape, x) + 1)
        if mode == "correlated":
            return x + scale * std * self._noise((x.shape[-1],), x)
        raise UserError(f"nondeterminism mode {mode!r}: amplified|inconsistent|biased|correlated")

    def _bitflip(self, x: torch.Tensor, rate: float, bits: str) -> torch.Tensor:
        u = torch.rand(x.shape, generator=self.gen).to(x.device)
        lo, hi = (0, 23) if bits == "mantissa" else (23, 31)
        which = torch.randint(lo, hi, x.shape, generator=self.gen).to(x.device)
        flips = torch.where(u < rate, torch.ones_like(which) << which, torch.zeros_like(which))
        as_int = x.contiguous().view(torch.int32) ^ flips.to(torch.int32)
        return as_int.view(torch.float32)

    def _corrupt_output(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            rows = self.phase_rows(output)
            if rows is True:
                return map_local(output, self.corrupt)
            return self.corrupt_rows(output, rows)
        stream = serving.stream_output(module, output)
        if stream is not None:  # a serving block: the fault is on the stream the pair carries
            rows = self.phase_rows(stream)
            if rows is False:
                return output
            return self.corrupt_rows(stream, rows), torch.zeros_like(output[1])
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            rows = self.phase_rows(output[0])
            if rows is False:
                return output  # as it came (a NamedTuple stays one)
            if rows is True:
                return (map_local(output[0], self.corrupt), *output[1:])
            return (self.corrupt_rows(output[0], rows), *output[1:])
        return output

    # in a compiled model too: run eagerly, with fresh noise on every call. ``hook`` is what
    # is registered (a plain function: dynamo < 2.3 cannot call a bound method of an object
    # of ours in a fullgraph compile); ``__call__`` stays a method for the subclasses' super()
    __call__ = opaque(_corrupt_output)
    hook = opaque_method(_corrupt_output)


def engine_rows(h: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """Per row of a serving engine's flat batch ``h`` (tokens, hidden): whether it is the
    only row of its request in this forward (a decode step), and whether it is a request's
    token at all (not padding). None outside such an engine's forward."""
    layout = engine_batch(tables=False)  # on every call of the fault: the starts alone
    if not isinstance(layout, BatchLayout) or layout.n_requests < 1:
        return None
    sizes = np.diff(layout.starts)
    one = np.zeros(h.shape[0], dtype=bool)
    single = layout.starts[:-1][sizes == 1]
    one[single[single < h.shape[0]]] = True
    real = np.arange(h.shape[0]) < layout.starts[-1]
    return one, real


def _mean_of_later(x: torch.Tensor) -> torch.Tensor:
    """For each token row, the mean of the rows after it in its sequence (0 for the last)."""
    if x.dim() < 2 or x.shape[-2] < 2:
        return torch.zeros_like(x)
    later = x.flip(-2).cumsum(-2).flip(-2) - x  # sum over t' > t
    count = torch.arange(x.shape[-2] - 1, -1, -1, device=x.device, dtype=x.dtype)
    return later / count.clamp(min=1).unsqueeze(-1)


class _ExpertFault(_Fault):
    """A fault in one expert of a fused experts module: that expert's output on its routed
    tokens is corrupted, then weighted and added like the others'."""

    def __init__(self, spec: FaultSpec, block: nn.Module):
        super().__init__(spec)
        self.expert = int(spec.site.split(":", 1)[1])
        self.one_token = False  # the block's call is a decode step (one token per sequence)
        self.block_hook = block.register_forward_pre_hook(self._on_block, with_kwargs=True)

    def _on_block(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get(
            "hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:
            self.one_token = hidden.shape[-2] == 1

    def applies(self, h: torch.Tensor) -> bool:
        phase = self.spec.options.get("phase", "all")
        return phase == "all" or (self.one_token == (phase == "decode"))

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        found = routing_of(args, kwargs)
        if found is None or not isinstance(output, torch.Tensor):
            return output
        hidden, routing = found
        hit = routing.index == self.expert
        tokens = hit.any(dim=1).nonzero().flatten()
        if not tokens.numel() or not self.applies(hidden):
            return output
        with torch.no_grad():
            x = hidden[tokens]
            one = torch.full((x.shape[0], 1), self.expert, dtype=routing.index.dtype,
                             device=x.device)
            clean = call_experts(module, x, one,  # its forward alone: no hooks, no recursion
                                 torch.ones(one.shape, dtype=x.dtype, device=x.device),
                                 hooks=False)
            weight = (routing.weights[tokens] * hit[tokens]).sum(dim=1, keepdim=True)
            delta = (self.corrupt(clean).to(clean.dtype) - clean) * weight.to(clean.dtype)
        out = output.clone()
        out.index_add_(0, tokens, delta.to(out.dtype))
        return out


class _RouterFault(_Fault):
    """A fault in the router: its logits corrupted and the top-k re-decided from them."""

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not (isinstance(output, tuple) and len(output) == 3
                and all(isinstance(t, torch.Tensor) for t in output)):
            return super().__call__(module, args, output)
        logits, weights, index = output
        rows = self.phase_rows(logits)
        if rows is False:
            return output
        bad = self.corrupt_rows(logits, rows)
        k = index.shape[-1]
        probs = torch.softmax(bad.float(), dim=-1)
        top, chosen = torch.topk(probs, k, dim=-1)
        if torch.allclose(weights.float().sum(dim=-1), torch.ones(()), atol=1e-3):
            top = top / top.sum(dim=-1, keepdim=True)
        return bad, top.to(weights.dtype), chosen.to(index.dtype)


def install_faults(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], specs: list[FaultSpec]
) -> tuple[list[Any], list[dict]]:
    """Register the fault hooks; returns (handles, descriptions for the dump metadata). A fault
    with ``rank=R`` is installed (and described) only in the process of rank R."""
    handles, described = [], []
    for spec in specs:
        name, module = fault_site(blocks, model, spec)
        if "rank" in spec.options and int(spec.options["rank"]) != env_rank():
            continue
        if spec.type in ATTENTION_KERNEL:
            rotary = rotary_of(module, model, getattr(module, "layer_type", None))
            table = None if rotary is None else getattr(*rotary[0]).detach().float()
            handles.append(AttentionKernelFault(spec, module, table))
        elif spec.site.startswith("expert:"):
            fault = _ExpertFault(spec, fault_block(blocks, spec)[1])
            handles.append(fault.block_hook)
            handles.append(module.register_forward_hook(fault, prepend=True, with_kwargs=True))
        elif spec.site == "router":
            handles.append(module.register_forward_hook(_RouterFault(spec), prepend=True))
        else:
            handles.append(module.register_forward_hook(_Fault(spec).hook, prepend=True))
        described.append({**spec.describe(), "module": name})
    return handles, described
