"""The repeats of a block's sub-layers taken from the block's own repeats.

A repeat re-runs a module unperturbed on its recorded input. A decoder block's repeat runs its
attention and MLP sub-layers again; when a sub-layer's input in that run is bit for bit its
recorded input, its output there *is* a repeat of the sub-layer, and running the sub-layer a
third, fourth and fifth time on its own would compute the same thing again. So a sub-layer's
probes run without repeats, the sub-layer waits (``defer``), and the block's repeat ``t``
takes each waiting sub-layer's output (``around``). A sub-layer whose input differs in the
block's run (an unstable operator before it in the block) or that was not called exactly once
re-runs alone, as before (``finish``): what a repeat record holds does not change.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..format import schema
from .probes import ProbeOutput, hidden_input, module_output


@dataclass
class Waiting:
    """A sub-layer whose probes ran, waiting for its repeats."""

    module: nn.Module
    site: int
    x: torch.Tensor  # its recorded hidden-state input
    again: Callable[[], torch.Tensor]  # its own repeat (probes.repeat_call)
    outputs: list[ProbeOutput]  # its probe outputs so far
    emit: Callable[[list[ProbeOutput]], None]  # hands the complete outputs on
    repeats: dict[int, torch.Tensor] = field(default_factory=dict)


class SharedRepeats:
    """The sub-layers of each layer waiting for their block's repeats, this round."""

    def __init__(self, repeats: int):
        self.n = repeats
        self.waiting: dict[int, list[Waiting]] = {}  # layer -> its waiting sub-layers
        self.taken = self.alone = 0  # repeats taken from a block's run / run alone

    def clear(self) -> None:
        self.waiting.clear()

    def defer(self, layer: int, waiting: Waiting) -> None:
        self.waiting.setdefault(layer, []).append(waiting)

    def deferred(self, layer: int, site: int) -> bool:
        return any(w.site == site for w in self.waiting.get(layer, ()))

    @contextmanager
    def around(self, layer: int, t: int) -> Iterator[None]:
        """Around the block's repeat ``t``: each waiting sub-layer's one call in it is kept
        when its input is its recorded input."""
        calls: dict[int, list[tuple[Any, Any]]] = {}
        handles = []
        for w in self.waiting.get(layer, ()):
            def hook(module, args, kwargs, output, w=w):
                x, _ = hidden_input(args, kwargs, module)
                out = module_output(module, output)
                same = (isinstance(x, torch.Tensor) and x.shape == w.x.shape
                        and x.dtype == w.x.dtype and torch.equal(x, w.x))
                # a parent may write into the output afterwards (a fused add): a copy
                calls.setdefault(w.site, []).append(
                    (same, out.clone() if isinstance(out, torch.Tensor) else None))
            handles.append(w.module.register_forward_hook(hook, with_kwargs=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        for w in self.waiting.get(layer, ()):
            got = calls.get(w.site, [])
            if len(got) == 1 and got[0][0] and got[0][1] is not None:
                w.repeats[t] = got[0][1]

    def finish(self, layer: int) -> list[tuple[Waiting, Exception]]:
        """The waiting sub-layers of ``layer`` get their repeats (run alone where the block's
        run gave none) and are handed on; those whose own repeat failed are returned."""
        failed = []
        for w in self.waiting.pop(layer, []):
            outputs = list(w.outputs)
            try:
                for t in range(self.n):
                    out = w.repeats.get(t)
                    if out is None:
                        out = w.again()
                        self.alone += 1
                    else:
                        self.taken += 1
                    outputs.append(ProbeOutput(schema.KIND_REPEAT, t, 0.0, 0, out, None))
            except Exception as exc:  # noqa: BLE001 (the caller decides, as for any replay)
                failed.append((w, exc))
                continue
            w.emit(outputs)
        return failed
