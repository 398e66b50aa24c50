"""Layer-local replay probes: re-run one module on the input it was just given.

For a module call ``out = module(*args, **kwargs)`` whose hidden-state input is ``x``:

* gain:   ``x + sigma * rowstd(x) * eps``, eps ~ N(0, 1) from a seeded CPU generator;
* dc:     ``x + c * rowstd(x)`` (the same shift on every element of a token row);
* repeat: ``x`` again, T times, with exactly the original shapes (run-to-run instability).

``rowstd`` is the standard deviation of each token's hidden vector, so the perturbation has the
same relative size on every token, whatever the scale of outlier tokens. gain and dc inputs
are replayed in one batched call together with an unperturbed copy (the in-batch reference),
so batched-GEMM rounding cancels out of the response; when a module refuses a batch, every
input is replayed on its own and the reference is the recorded output itself.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..format import schema
from . import serving


@dataclass
class ProbeSpec:
    """The probes of one capture session (built from DumpConfig, which holds the defaults)."""

    sigmas: tuple[float, ...]  # gain noise sizes, relative to each token's std
    draws: int  # noise draws per sigma
    dc: tuple[float, ...]  # dc shifts in token stds
    repeats: int  # unperturbed re-runs
    batched: bool  # perturbed copies replayed in one batched call
    scale: bool = False  # the scale identity of linear operators (identities.scale_replays)
    causal: bool = False  # the causality copy of causal attentions and blocks
    attention: bool = False  # the reference attention (attention_reference.py)
    mlp: bool = False  # the reference MLP (mlp_reference.py)
    norm: bool = False  # the float64 host replay of a norm's probe rows (replays._rows)

    @classmethod
    def of(cls, config: Any) -> ProbeSpec:
        """The probes a ``DumpConfig`` asks for (``--probes`` picks the kinds)."""
        probes = config.parsed().probes
        return cls(
            sigmas=tuple(config.sigmas) if "gain" in probes else (),
            draws=config.draws,
            dc=tuple(config.dc) if "dc" in probes else (),
            repeats=config.repeats if "repeat" in probes else 0,
            batched=config.batch_probes,
            scale="scale" in probes,
            causal="causal" in probes,
            attention="attention" in probes,
            mlp="mlp" in probes,
            norm="norm" in probes,
        )


@dataclass
class ProbeOutput:
    kind: int
    probe: int
    param: float
    seed: int
    output: torch.Tensor  # same shape as the module's hidden-state output
    perturbation: torch.Tensor | None  # what was added to the input (None for repeats)


def this_thread() -> Callable[[], bool]:
    """A test that a call runs in the thread that made it: a replay's hooks leave alone the
    program's own calls of the same module in other threads."""
    me = threading.get_ident()
    return lambda: threading.get_ident() == me


def probe_seed(*parts: int) -> int:
    return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


def is_cache(value: Any) -> bool:
    """A KV cache object (transformers' Cache classes) that a replay must not update."""
    return hasattr(value, "update") and hasattr(value, "get_seq_length")


class FrozenCache:
    """One layer's KV cache as it was before the recorded call. A decode step's replay attends
    to the same past keys and values as the device did (plus its own new token), and the real
    cache is left alone: ``update`` returns the concatenation without storing it. A static
    cache's buffer (``written``: the tokens in it, the rest of its fixed length unused and
    masked by the call's mask) is returned whole with the new entries written at ``written``
    into a copy, as the static cache returns it."""

    def __init__(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor,
                 written: int | None = None):
        self.layer_idx, self.keys, self.values = layer_idx, keys, values
        self.written = written

    def update(self, key_states, value_states, *args, **kwargs):
        # whatever else the library passes (layer index, cache_kwargs=, kwargs=...) is about
        # where to store the new entries, which a frozen cache never does
        if self.written is not None:
            return (_into_static(self.keys, key_states, self.written),
                    _into_static(self.values, value_states, self.written))
        return _after(self.keys, key_states), _after(self.values, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.keys.shape[-2]) if self.written is None else self.written


def _into_static(buffer: torch.Tensor, new: torch.Tensor, at: int) -> torch.Tensor:
    """A copy of a static cache's ``buffer`` (once per stacked copy of a batched replay) with
    ``new`` written from position ``at``."""
    reps = new.shape[0] // max(1, buffer.shape[0])
    out = buffer.repeat(reps, *([1] * (buffer.dim() - 1)))
    out[..., at:at + new.shape[-2], :] = new
    return out


def _after(past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``past`` followed by ``new`` along the sequence, in one copy; a batched replay of
    stacked copies (``new`` holding several batches) gets the past once per copy."""
    reps = new.shape[0] // max(1, past.shape[0])
    out = past.new_empty((past.shape[0] * reps, *past.shape[1:-2],
                          past.shape[-2] + new.shape[-2], past.shape[-1]))
    out.view(reps, past.shape[0], *out.shape[1:])[..., :past.shape[-2], :] = past
    out[..., past.shape[-2]:, :] = new
    return out


def layer_index(module: nn.Module) -> int | None:
    """The cache layer index of an attention module or of the first one inside a block."""
    for m in module.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int):
            return idx
    return None


def cache_in(args: tuple, kwargs: dict) -> Any:
    """The Cache object a call was given, or None."""
    return next((v for v in (*args, *kwargs.values()) if is_cache(v)), None)


def snapshot_cache(idx: int, args: tuple, kwargs: dict) -> FrozenCache | str:
    """A FrozenCache of cache layer ``idx`` from the cache in a call, before the call updates
    it; else why not, in words (no cache object, no past in it, a layout this does not know)."""
    cache = cache_in(args, kwargs)
    if cache is None:
        return "the call's cache is not a Cache object (a legacy tuple cache)"
    kind = type(cache).__name__
    keys, values = cache_layer(cache, idx)
    if isinstance(keys, str):
        return keys
    if keys is None or (isinstance(keys, torch.Tensor) and keys.dim() == 4
                        and keys.shape[-2] == 0):
        # a one-token call whose cache holds nothing yet: the program called the model
        # without the keys and values of its earlier tokens
        return f"its {kind} holds no earlier keys and values for layer {idx}"
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
        return f"a cache layout srdd-dump does not know ({kind})"
    try:  # a static or sliding cache holds a buffer longer than the past
        length = int(cache.get_seq_length(idx))
    except Exception:  # noqa: BLE001 (a cache class of another layout)
        return f"a cache layout srdd-dump does not know ({kind})"
    written = None
    if keys.shape[-2] != length:
        length = _first_position(kwargs, length)
        if not _static(cache, idx, keys, length):  # a sliding window's rolling buffer
            return (f"its {kind} holds a buffer of another length than the past (a "
                    "sliding-window cache)")
        written = length
    return FrozenCache(idx, keys.detach().clone(), values.detach().clone(), written)


def _first_position(kwargs: dict, length: int) -> int:
    """Where a call's first new token goes in a static buffer: its ``cache_position`` where
    the library passes one (transformers 4.x counts a static cache's length as its non-zero
    keys of row 0: short by the pad tokens an embedding maps to zeros), else ``length``."""
    where = kwargs.get("cache_position")
    if isinstance(where, torch.Tensor) and where.numel():
        return int(where.reshape(-1)[0])
    return length


def static_after_prefill(idx: int | None, args: tuple, kwargs: dict, seq: int
                         ) -> FrozenCache | None:
    """A prefill's static cache as its replays need it, read after the call wrote its ``seq``
    tokens: the attention's mask spans the buffer's whole length, so a replay without a cache
    would attend fewer keys than its mask covers. The buffer as it is (the call's own entries
    are written over by each replay's); None for any other cache or none."""
    cache = cache_in(args, kwargs)
    if cache is None or idx is None:
        return None
    keys, values = cache_layer(cache, idx)
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
        return None
    try:
        past = _first_position(kwargs, int(cache.get_seq_length(idx)) - seq)
    except Exception:  # noqa: BLE001 (a cache class of another layout)
        return None
    if past < 0 or not _static(cache, idx, keys, past):
        return None
    return FrozenCache(idx, keys.detach().clone(), values.detach().clone(), past)


def cache_layer(cache: Any, idx: int) -> tuple[Any, Any]:
    """(keys, values) of cache layer ``idx`` of a Cache object, as it holds them now (None,
    None: not filled yet), or (why, None)."""
    try:
        if hasattr(cache, "layers"):  # transformers >= 4.56
            layers = cache.layers
            return (layers[idx].keys, layers[idx].values) if idx < len(layers) else (None, None)
        layers = cache.key_cache
        return ((cache.key_cache[idx], cache.value_cache[idx]) if idx < len(layers)
                else (None, None))
    except (TypeError, AttributeError, KeyError):
        return f"a cache layout srdd-dump does not know ({type(cache).__name__})", None


def _static(cache: Any, idx: int, keys: torch.Tensor, length: int) -> bool:
    """Cache layer ``idx`` is a static one: a fixed-length buffer holding the past in its
    first ``length`` positions and writing the next tokens after them (transformers' static
    layers; 4.x's StaticCache), not a sliding window's rolling one."""
    if not 0 <= length < keys.shape[-2]:
        return False
    if hasattr(cache, "layers"):  # transformers >= 4.56: a cache of layers, each its kind
        layer = cache.layers[idx]
        return (getattr(layer, "is_sliding", True) is False
                and getattr(layer, "max_cache_len", None) == keys.shape[-2])
    return type(cache).__name__ == "StaticCache"


def replay_arguments(args: tuple, kwargs: dict, cache: FrozenCache | None = None
                     ) -> tuple[tuple, dict]:
    """The call's arguments with every KV cache replaced by ``cache`` (a snapshot of the layer's
    past, for a decode step) or removed, and caching turned off."""
    args = tuple(cache if is_cache(a) else a for a in args)
    clean = {}
    for key, value in kwargs.items():
        if is_cache(value) or "past_key_value" in key or key == "layer_past":
            value = cache if is_cache(value) else None
        elif key == "use_cache":
            value = False
        elif key == "output_attentions":
            value = False
        clean[key] = value
    return args, clean


def hidden_input(args: tuple, kwargs: dict, module: nn.Module | None = None,
                 stream: bool = False, fused_add: bool = False
                 ) -> tuple[torch.Tensor | None, Callable]:
    """The hidden-state input of a call and a function that rebuilds the call with another:
    the residual stream of a serving block (``stream``: a block of the session's stack that
    returns ``(hidden_states, residual)``; serving.py), the parameter named ``hidden_states``,
    or the first floating-point positional tensor (``positions`` may come first). A sub-layer
    that merely takes ``residual`` for its fused add (HF Bloom's and MPT's attention and MLP)
    is perturbed on its ``hidden_states``: the residual only passes through it. A norm that
    adds its residual first (``fused_add``) is perturbed on the sum it normalises."""
    if fused_add:
        x, rebuild = serving.fused_add_perturbation(args, kwargs)
        if x is not None:
            return x, rebuild
    if module is not None:
        if stream and serving.is_serving_block(module):
            x, rebuild = serving.stream_perturbation(module, args, kwargs)
            if x is not None:
                return x, rebuild
        x, rebuild = serving.named_input(module, args, kwargs)
        if x is not None:
            return x, rebuild
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a, lambda x, i=i: ((*args[:i], x, *args[i + 1:]), kwargs)
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"], lambda x: (args, {**kwargs, "hidden_states": x})
    return None, lambda x: (args, kwargs)


def first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                return item
    return None


@contextlib.contextmanager
def preserved_rng(device: torch.device):
    """Nothing a replay does to the global RNG streams is visible afterwards."""
    devices = [] if device.type == "cpu" else [device.index or 0]
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        yield


@contextlib.contextmanager
def outside_output_recording(module: nn.Module) -> Iterator[None]:
    """The replays of ``module`` add nothing to the outputs the model call is collecting
    (``hidden_states``, ``attentions``, ``router_logits``): a replay inside the call would
    lengthen the user's tuples and change an MoE ``aux_loss``. transformers >= 5 records them
    through forward hooks that append to the call's active collector
    (``utils/output_capturing._active_collector``): paused. transformers 4.5x's
    ``check_model_inputs`` replaces the recorded modules' ``forward`` with a wrapper
    (``wrapped_forward``, its original as ``__wrapped__``): the module's own forwards run (a
    replay made a 4-layer Llama return 17 hidden states instead of 5)."""
    recording = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(recording, "_active_collector", None)
    if collector is None or not hasattr(collector, "set"):
        with _own_forwards(module):
            yield
        return
    if getattr(collector, "compiling", False):  # a compiled model call: a plain global
        held, collector.global_var = collector.global_var, None
        try:
            yield
        finally:
            collector.global_var = held
        return
    token = collector.set(None)
    try:
        yield
    finally:
        collector.reset(token)


@contextlib.contextmanager
def _own_forwards(module: nn.Module) -> Iterator[None]:
    """``module``'s modules run their own forwards, not transformers 4.5x's recording
    wrappers."""
    patched = []
    for m in module.modules():
        forward = m.__dict__.get("forward")
        code = getattr(forward, "__code__", None)
        if code is not None and code.co_name == "wrapped_forward" and hasattr(
                forward, "__wrapped__"):
            m.forward = forward.__wrapped__
            patched.append((m, forward))
    try:
        yield
    finally:
        for m, forward in patched:
            m.forward = forward


def _row_std(x: torch.Tensor) -> torch.Tensor:
    return x.float().std(dim=-1, keepdim=True, unbiased=False)


CAUSAL_SIGMA = 1.0  # noise added to the tokens after the cut, in token stds


def perturbed_inputs(
    x: torch.Tensor, spec: ProbeSpec, seeds: Callable[[int, int], int],
    causal_cut: int | None = None, causal_stop: int | None = None,
) -> list[tuple[int, int, float, int, torch.Tensor]]:
    """[(kind, probe, param, seed, x + delta)] for every gain draw and dc constant, and with
    ``causal_cut`` a copy whose tokens at and after that position carry noise (up to
    ``causal_stop``: the end of one request in a serving engine's flat batch)."""
    std = _row_std(x)
    out = []
    probe = 0
    for sigma in spec.sigmas:
        for _ in range(spec.draws):
            seed = seeds(schema.KIND_GAIN, probe)
            gen = torch.Generator().manual_seed(seed)
            eps = torch.randn(x.shape, generator=gen, dtype=torch.float32).to(x.device)
            xp = (x.float() + sigma * std * eps).to(x.dtype)
            out.append((schema.KIND_GAIN, probe, sigma, seed, xp))
            probe += 1
    for k, c in enumerate(spec.dc):
        out.append((schema.KIND_DC, k, c, 0, (x.float() + c * std).to(x.dtype)))
    if causal_cut is not None and x.dim() >= 2 and 0 < causal_cut < x.shape[-2]:
        seed = seeds(schema.KIND_CAUSAL, 0)
        gen = torch.Generator().manual_seed(seed)
        eps = torch.randn(x.shape, generator=gen, dtype=torch.float32).to(x.device)
        eps[..., :causal_cut, :] = 0
        if causal_stop is not None:
            eps[..., causal_stop:, :] = 0
        xp = (x.float() + CAUSAL_SIGMA * std * eps).to(x.dtype)
        xp[..., :causal_cut, :] = x[..., :causal_cut, :]  # bit-identical before the cut
        if causal_stop is not None:  # and after the request
            xp[..., causal_stop:, :] = x[..., causal_stop:, :]
        out.append((schema.KIND_CAUSAL, 0, float(causal_cut), seed, xp))
    return out


def _expand(value: Any, batch: int, copies: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch > 1:
        return torch.cat([value] * copies, dim=0)
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_expand(v, batch, copies) for v in value)
    return value


def module_output(module: nn.Module, value: Any) -> torch.Tensor | None:
    """The hidden-state output of a call: a serving block's residual stream, or the first
    tensor."""
    stream = serving.stream_output(module, value)
    return stream if stream is not None else first_tensor(value)


def _call(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    if serving.overwrites_inputs(module):  # each call its own copies
        args, kwargs = serving.frozen_call(module, args, kwargs)
    out = module_output(module, module(*args, **kwargs))
    if out is None:
        raise TypeError(f"{type(module).__name__} returned no tensor on replay")
    return out


def run_probes(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    recorded: torch.Tensor,
    spec: ProbeSpec,
    seeds: Callable[[int, int], int],
    cache: FrozenCache | None = None,
    causal_cut: int | None = None,
    stream: bool = False,
    causal_stop: int | None = None,
    around_repeat: Callable[[int], contextlib.AbstractContextManager] | None = None,
    extra: tuple[tuple[int, torch.Tensor], ...] = (),
    rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
    fused_add: bool = False,
) -> tuple[list[ProbeOutput], bool]:
    """Replay ``module`` on perturbed copies of its input; returns (outputs, batched?).

    The first output is the reference (KIND_REPLAY) the perturbed outputs are compared with.
    ``cache``: the layer's KV cache before the recorded call (a decode step). ``stream``: the
    module is a serving block of the stack (``hidden_input``). ``around_repeat(t)``: a context
    entered around the module's repeat ``t`` (the repeats of the sites inside it are taken
    from it: replays.SharedRepeats). ``extra``: (kind, input) copies replayed in the same
    batched call as the perturbed ones (the zero identity of a fused experts call), recorded
    without a perturbation. ``rows``: a row-wise module whose perturbed copies run on some
    rows of its input alone (``recorded`` holds those rows): the inputs are perturbed whole,
    as without it, then cut to those rows; its repeats re-run the whole call (the call's own
    shapes), their outputs cut to those rows. ``fused_add``: a norm called with a residual it
    adds first (serving.fused_add_perturbation).
    """
    args, kwargs = replay_arguments(args, kwargs, cache)
    x, rebuild = hidden_input(args, kwargs, module, stream, fused_add)
    if x is None:
        raise TypeError(f"cannot find the hidden-state input of {type(module).__name__}")
    results: list[ProbeOutput] = []
    with torch.no_grad(), preserved_rng(x.device):
        perturbed = perturbed_inputs(x, spec, seeds, causal_cut, causal_stop)
        whole, cut = x, rows or (lambda t: t)
        if rows is not None:
            x = rows(x)
            perturbed = [(*head, rows(xp)) for *head, xp in perturbed]
        n_perturbed = len(perturbed)
        perturbed += [(kind, 0, 0.0, 0, xe) for kind, xe in extra]
        batched = (spec.batched and bool(perturbed) and x.dim() >= 2
                   and not serving.replays_alone(module))
        outputs = None
        if batched:
            outputs = _batched(module, x, rebuild, perturbed, recorded)
            batched = outputs is not None
        if outputs is None:
            outputs = [recorded] + [_call(module, *rebuild(xp)) for *_, xp in perturbed]
        results.append(ProbeOutput(schema.KIND_REPLAY, 0, 0.0, 0, outputs[0], None))
        for i, ((kind, probe, param, seed, xp), out) in enumerate(zip(perturbed, outputs[1:])):
            delta = xp.float() - x.float() if i < n_perturbed else None
            results.append(ProbeOutput(kind, probe, param, seed, out, delta))
        for t in range(spec.repeats):
            with around_repeat(t) if around_repeat is not None else contextlib.nullcontext():
                out = cut(_call(module, *rebuild(whole)))
            results.append(ProbeOutput(schema.KIND_REPEAT, t, 0.0, 0, out, None))
        if n_perturbed and not spec.repeats and serving.replays_alone(module):
            _call(module, *rebuild(x))  # writes back the KV cache entries the call wrote
    return results, batched


def repeat_call(module: nn.Module, args: tuple, kwargs: dict, cache: FrozenCache | None = None
                ) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """A copy of the hidden-state input of a recorded call and a function that re-runs the
    call on it unperturbed (a repeat), as ``run_probes`` does."""
    args, kwargs = replay_arguments(args, kwargs, cache)
    x, rebuild = hidden_input(args, kwargs, module)
    if x is None:
        raise TypeError(f"cannot find the hidden-state input of {type(module).__name__}")
    x = x.clone()  # the recorded input as it was: the model may change it in place later

    def again() -> torch.Tensor:
        with torch.no_grad(), preserved_rng(x.device):
            return _call(module, *rebuild(x))

    return x, again


def other_kernels(outputs: list[ProbeOutput], recorded: torch.Tensor) -> bool:
    """The unperturbed re-runs agree with each other bit for bit but not with the recorded
    output: it came from other kernels (compiled code), not from run-to-run noise. True when
    there is no re-run to tell."""
    repeats = [p.output for p in outputs if p.kind == schema.KIND_REPEAT]
    if not repeats:
        return True
    if all(torch.equal(out, recorded) for out in repeats):
        return False
    return all(torch.equal(out, repeats[0]) for out in repeats[1:])


def _batched(module, x, rebuild, perturbed, recorded) -> list[torch.Tensor] | None:
    """One call on [x, x+d1, x+d2, ...] stacked along the batch; None if the module refuses."""
    batch = x.shape[0] if x.dim() >= 3 else 1
    copies = 1 + len(perturbed)
    if x.dim() == 2:
        stacked = torch.stack([x] + [xp for *_, xp in perturbed])
    else:
        stacked = torch.cat([x] + [xp for *_, xp in perturbed], dim=0)
    args, kwargs = rebuild(stacked)
    args = tuple(a if a is stacked else _expand(a, batch, copies) for a in args)
    kwargs = {k: (v if v is stacked else _expand(v, batch, copies)) for k, v in kwargs.items()}
    try:
        out = _call(module, args, kwargs)
    except Exception:
        return None
    want = (copies * batch, *recorded.shape[1:]) if x.dim() >= 3 else (copies, *recorded.shape)
    if tuple(out.shape) != want:
        return None
    if x.dim() == 2:
        return list(out.unbind(0))
    return list(out.split(batch, dim=0))
