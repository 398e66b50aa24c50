"""The repeats of a block's sub-layers taken from the block's own repeats.

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
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..format import schema
from .probes import ProbeOutput, hidden_input, module_output, this_thread


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


class SharedRepeats:
    """The sub-layers of each layer waiting for their block's repeats, this round."""

    def __init__(self, repeats: int):
        self.n = repeats
        self.waiting: dict[int, list[Waiting]] = {}  # layer -> its waiting sub-layers
        self.taken = 0  # repeats taken from a block's run (status: repeats_from_blocks)

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
            replaying = this_thread()
            for w in self.waiting.get(layer, ()):
                def hook(module, args, kwargs, output=None, w=w):
                    # the program's own call in another thread (which may also see the hook
                    # removed half-way through its call: torch then passes no output)
                    if not replaying() or output is None:
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

    def finish(self, layer: int) -> list[tuple[Waiting, Exception]]:
        """The waiting sub-layers of ``layer`` get their repeats (run alone where the block's
        run gave none) and are handed on; those whose repeat or hand-over failed are
        returned (each is handed on at most once)."""
        failed = []
        for w in self.waiting.pop(layer, []):
            outputs = list(w.outputs)
            try:
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


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (torch.equal holds -0.0 == 0.0): the integer views, where the dtype has
    one."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    if ints is None or not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
