"""The repeats and perturbed replays of a block's sub-layers taken from the block's own.

A repeat re-runs a module unperturbed on its recorded input. A decoder block's repeat runs its
attention and MLP sub-layers again; when a sub-layer's input in that run is bit for bit its
recorded input, its output there *is* a repeat of the sub-layer, and running the sub-layer a
third, fourth and fifth time on its own would compute the same thing again. So a sub-layer's
probes run without repeats, the sub-layer waits (``defer``), and the block's repeat ``t``
takes each waiting sub-layer's output (``around``). A sub-layer whose input differs in the
block's run (an unstable operator before it in the block) or that was not called exactly once
re-runs alone, as before (``finish``): what a repeat record holds does not change.

A site may read its repeat off the call in another way (``Waiting.repeat_from``): a fused
experts call's slots are a second call of the experts module on the same input, so the block's
repeat gives them only when its experts call reproduced the recorded output bit for bit
(moe_capture.py).

The perturbed copies the same way (``around_batch``): the block's batched replay runs each
sub-layer on the copies of the block's input as they reach it (the block's gain and dc
perturbations, and its causality copy, after the norm before the sub-layer and, for the MLP,
the attention). When the sub-layer's input in the unperturbed copy is bit for bit its recorded
input, that call is the sub-layer's own batched probe replay, with the perturbations that
arrived in place of its own draws: its in-batch reference is its recorded input replayed in a
batch, each copy's perturbation is what differs from it. A sub-layer whose input differs there,
or that the batch does not reach, runs its own perturbed replay at ``finish``, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..format import schema
from .probes import ProbeOutput, hidden_input, module_output


@dataclass
class Waiting:
    """A sub-layer whose probes ran, waiting for its repeats."""

    module: nn.Module
    site: int
    x: torch.Tensor  # a copy of its recorded hidden-state input
    again: Callable[[], torch.Tensor]  # its own repeat on that copy, cut to its stored rows
    outputs: list[ProbeOutput]  # its probe outputs so far, cut to its stored rows (copies)
    emit: Callable[[list[ProbeOutput]], None]  # hands the complete outputs on
    family: str  # its probes' coverage family (counted as ran when they ran)
    repeats: dict[int, torch.Tensor] = field(default_factory=dict)
    # its repeat from its call's output in the block's run (None: not given there); by
    # default that output cut to its stored rows
    repeat_from: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    # its own perturbed replays, cut to its stored rows, when they have not run: from the
    # block's batched replay (``around_batch``) or, failing that, run at ``finish``
    probes: Callable[[], list[ProbeOutput]] | None = None
    causal: bool = False  # the causality copy is one of its probes (a causal attention)


class SharedRepeats:
    """The sub-layers of each layer waiting for their block's repeats, this round."""

    def __init__(self, repeats: int):
        self.n = repeats
        self.waiting: dict[int, list[Waiting]] = {}  # layer -> its waiting sub-layers
        self.taken = 0  # repeats taken from a block's run (status: repeats_from_blocks)
        self.batches_taken = 0  # perturbed replays taken from one (probes_from_blocks)

    def clear(self) -> None:
        self.waiting.clear()

    def defer(self, layer: int, waiting: Waiting) -> None:
        self.waiting.setdefault(layer, []).append(waiting)

    def deferred(self, layer: int, site: int) -> bool:
        return any(w.site == site for w in self.waiting.get(layer, ()))

    @contextmanager
    def around(self, layer: int, t: int, cut: Callable[[torch.Tensor], torch.Tensor]
               ) -> Iterator[None]:
        """Around the block's repeat ``t``: each waiting sub-layer's one call in it is kept
        (``cut`` to its stored rows: a copy, which a later in-place add cannot change) when
        its input is its recorded input. Never raises into the block's run: a call that
        cannot be judged is not kept (the sub-layer then re-runs alone)."""
        calls: dict[int, list[torch.Tensor | None]] = {}
        handles = []
        try:
            replaying = threading.get_ident()
            for w in self.waiting.get(layer, ()):
                def hook(module, args, kwargs, output=None, w=w):
                    # the program's own call in another thread (which may also see the hook
                    # removed half-way through its call: torch then passes no output)
                    if threading.get_ident() != replaying or output is None:
                        return
                    try:
                        x, _ = hidden_input(args, kwargs, module)
                        out = module_output(module, output)
                        same = (isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor)
                                and x.shape == w.x.shape and x.dtype == w.x.dtype
                                and x.device == w.x.device and bitwise_equal(x, w.x))
                        take = w.repeat_from or cut
                        calls.setdefault(w.site, []).append(take(out) if same else None)
                    except Exception:  # noqa: BLE001 (the sub-layer re-runs alone)
                        calls.setdefault(w.site, []).append(None)
                handles.append(w.module.register_forward_hook(hook, with_kwargs=True))
            yield
        finally:
            for h in handles:
                h.remove()
        for w in self.waiting.get(layer, ()):
            got = calls.get(w.site, [])
            if len(got) == 1 and got[0] is not None:
                w.repeats[t] = got[0]

    def awaits_batch(self, layer: int) -> bool:
        """A sub-layer of ``layer`` waits for its perturbed replays."""
        return any(w.probes is not None for w in self.waiting.get(layer, ()))

    @contextmanager
    def around_batch(self, layer: int, copies: list[tuple[int, int, float, int]], batch: int,
                     cut: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[BatchCall]:
        """Around the block's batched replay of ``copies`` (kind, probe, param, seed) after
        its unperturbed copy, ``batch`` rows of the batch dimension each: each waiting
        sub-layer's one call in it gives its perturbed replays when its input in the
        unperturbed copy is its recorded input (taken, ``cut`` to its stored rows, inside the
        call: the block may add into the sub-layer's output in place afterwards). Kept only
        when the caller marks the batch ``ok`` (a block that refused the batch may have run a
        sub-layer before failing). Never raises into the block's run."""
        waiting = [w for w in self.waiting.get(layer, ()) if w.probes is not None]
        calls: dict[int, list[list[ProbeOutput] | None]] = {}
        handles = []
        call = BatchCall()
        try:
            replaying = threading.get_ident()
            for w in waiting:
                def hook(module, args, kwargs, output=None, w=w):
                    if threading.get_ident() != replaying or output is None:
                        return  # the program's own call in another thread
                    try:
                        x, _ = hidden_input(args, kwargs, module)
                        got = _from_batch(w, x, module_output(module, output), copies, batch,
                                          cut)
                    except Exception:  # noqa: BLE001 (the sub-layer replays on its own)
                        got = None
                    calls.setdefault(w.site, []).append(got)
                handles.append(w.module.register_forward_hook(hook, with_kwargs=True))
            yield call
        finally:
            for h in handles:
                h.remove()
        if not call.ok:
            return
        for w in waiting:
            got = calls.get(w.site, [])
            if len(got) == 1 and got[0] is not None:
                w.outputs, w.probes = got[0], None
                self.batches_taken += 1

    def finish(self, layer: int) -> list[tuple[Waiting, Exception]]:
        """The waiting sub-layers of ``layer`` get their repeats (run alone where the block's
        run gave none) and are handed on; those whose repeat or hand-over failed are
        returned (each is handed on at most once)."""
        failed = []
        for w in self.waiting.pop(layer, []):
            try:
                outputs = list(w.outputs) if w.probes is None else w.probes()
                for t in range(self.n):
                    out = w.repeats.get(t)
                    if out is None:
                        out = w.again()
                    else:
                        self.taken += 1
                    outputs.append(ProbeOutput(schema.KIND_REPEAT, t, 0.0, 0, out, None))
                w.emit(outputs)
            except Exception as exc:  # noqa: BLE001 (the caller counts it, as for any replay)
                failed.append((w, exc))
        return failed


@dataclass
class BatchCall:
    ok: bool = False  # the block's batched replay succeeded: what its sub-layers gave counts


# the probe kinds a sub-layer takes from its block's batch (an extra copy, such as the zero
# identity of a fused experts call, is not one of its own)
SUBLAYER_KINDS = (schema.KIND_GAIN, schema.KIND_DC, schema.KIND_CAUSAL)


def _from_batch(w: Waiting, x: torch.Tensor | None, out: torch.Tensor | None,
                copies: list[tuple[int, int, float, int]], batch: int,
                cut: Callable[[torch.Tensor], torch.Tensor]) -> list[ProbeOutput] | None:
    """A sub-layer's probe outputs from its call in the block's batched replay (None when the
    call is not that batch of copies of its recorded input): the unperturbed copy's output as
    the reference, each perturbed copy's output with what differs at its input."""
    n = (1 + len(copies)) * batch
    if w.causal and all(kind != schema.KIND_CAUSAL for kind, *_ in copies):
        return None  # its causality probe is not among the block's copies
    if not (isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and x.dim() == 3
            and x.shape[0] == n and out.shape[0] == n):
        return None
    xs, outs = x.split(batch), out.split(batch)
    ref = xs[0]
    if not (ref.shape == w.x.shape and ref.dtype == w.x.dtype and ref.device == w.x.device
            and bitwise_equal(ref, w.x)):
        return None
    got = [ProbeOutput(schema.KIND_REPLAY, 0, 0.0, 0, cut(outs[0]), None)]
    base = ref.float()
    for (kind, probe, param, seed), xi, oi in zip(copies, xs[1:], outs[1:]):
        if kind in SUBLAYER_KINDS and (kind != schema.KIND_CAUSAL or w.causal):
            got.append(ProbeOutput(kind, probe, param, seed, cut(oi), cut(xi.float() - base)))
    return got


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (torch.equal holds -0.0 == 0.0): the integer views, where the dtype has
    one."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    if ints is None or not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
