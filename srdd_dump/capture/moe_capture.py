"""A fused experts call of a captured round (docs/dump-format.md, "Experts"): its routing, each
token slot's own expert output, and on the probe rows the slots' probe replays with the routing
held fixed, handed to the record sink (sinks.py: the tensors and the routing as records, or one
stats row per expert over the tokens routed to it). The slots' repeats of a probed round come
from the block's repeats where the block's experts call reproduces the recorded call bit for
bit (``PendingSlots``, shared_repeats.py); the slots call is re-run alone otherwise."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, NamedTuple

import torch
from torch import nn

from ..format import schema
from ..runtime.terminal import say
from .discovery import EXPERT, EXPERT_SLOTS, EXPERTS, ROUTER, Site
from .experts import (
    Routing,
    SlotReplay,
    bias_free,
    pinned_routing,
    routing_of,
    slot_outputs,
    topk_margin,
)
from .probes import ProbeOutput, ProbeSpec, run_probes
from .rounds import RoundContext
from .shared_repeats import bitwise_equal
from .sinks import RecordSink


class ExpertCapture:
    """The slots and per-expert records of every fused experts module of one session."""

    def __init__(self, sites: list[Site], sink: RecordSink, spec: ProbeSpec):
        self.sink, self.spec = sink, spec
        # the experts module's own sites share its module; its router is the layer's router
        index = {(id(site.module), site.role): i for i, site in enumerate(sites)}
        routers = {site.layer: id(site.module) for site in sites if site.role == ROUTER}
        members: dict[int, dict[int, int]] = {}
        for j, site in enumerate(sites):
            if site.role == EXPERT:
                members.setdefault(id(site.module), {})[site.expert] = j
        self.modules = [site.module for site in sites if site.role == EXPERTS]
        # site index of a fused experts module -> (its slots site, its expert sites by index);
        # none under expert parallelism (discovery gives it no slots)
        self.sites: dict[int, tuple[int, dict[int, int]]] = {}
        self.router_of: dict[int, int] = {}  # experts site -> its router module
        for i, site in enumerate(sites):
            if site.role != EXPERTS:
                continue
            if site.layer in routers:
                self.router_of[i] = routers[site.layer]
            slots = index.get((id(site.module), EXPERT_SLOTS))
            if slots is not None:
                self.sites[i] = (slots, members.get(id(site.module), {}))
        self.logits: dict[int, torch.Tensor] = {}  # router module -> its logits this round
        self.routing: dict[int, Routing] = {}  # experts module -> its routing this round

    @classmethod
    def of(cls, sites: list[Site], sink: RecordSink, spec: ProbeSpec) -> ExpertCapture | None:
        """The session's experts capture; None for a model without fused experts."""
        if not any(site.role == EXPERTS for site in sites):
            return None
        capture = cls(sites, sink, spec)
        if len(capture.sites) < len(capture.modules):
            say("srdd-dump: note: experts split over ranks (expert parallelism): "
                             "each MoE layer's experts are captured as their sum only\n")
        return capture

    def open_round(self) -> None:
        self.logits.clear()
        self.routing.clear()

    def pinned(self):
        """Routing held at this round's for a replay of a block or sub-block."""
        return pinned_routing(self.modules, self.routing)

    def router_output(self, module: nn.Module, logits: torch.Tensor) -> None:
        self.logits[id(module)] = logits

    def record(self, module: nn.Module, layer: int, site: int, args: tuple, kwargs: dict,
               output: torch.Tensor, ctx: RoundContext, share: bool = False
               ) -> PendingSlots | None:
        """A fused experts call of a captured round: its routing, then its slots' records
        (its replays run here: the caller holds its hooks off). ``share``: on a probed round
        the slots' repeats may come from the block's repeats; then nothing is handed to the
        sink yet and the call's pending slots are returned (the caller makes them wait)."""
        found = routing_of(args, kwargs)
        if found is None:  # counted (site_errors, coverage) by the session
            raise TypeError(f"the routing arguments of {type(module).__name__} (token indices "
                            "and weights) were not found in its call")
        hidden, routing = found
        self.routing[id(module)] = routing
        if site not in self.sites:
            return None
        slots_site, expert_sites = self.sites[site]
        logits = self.logits.pop(self.router_of.get(site, -1), None)
        if logits is not None and logits.numel() == hidden.shape[0] * logits.shape[-1]:
            margin = topk_margin(logits, routing.index).unsqueeze(-1)
        else:
            margin = torch.full((hidden.shape[0], 1), float("nan"), device=hidden.device)
        spec = self.spec
        wait = share and spec.repeats > 0 and ctx.probed and output.numel() == hidden.numel()
        with torch.no_grad():
            slots = slot_outputs(module, hidden, routing.index)
            probes, rows_index = self._probes(module, layer, slots_site, hidden, slots,
                                              routing, ctx, repeats=not wait)
        if not wait:
            self.sink.experts(ctx, layer, slots_site, expert_sites, slots, routing, margin,
                              probes, rows_index)
            return None
        # copies: the model's tensors may change after the call
        held = Routing(routing.index.clone(), routing.weights.clone())
        x, recorded = hidden.detach().clone(), output.detach().clone()
        clean = ctx.probe_rows(slots)

        def again() -> torch.Tensor:
            with torch.no_grad():
                return ctx.probe_rows(slot_outputs(module, x, held.index))

        def emit(outputs: list[ProbeOutput]) -> None:
            self.sink.experts(ctx, layer, slots_site, expert_sites, slots, held, margin,
                              outputs, rows_index)

        return PendingSlots(slots_site, x, again, probes, emit,
                            lambda out: _same_call(out, recorded, clean))

    def _probes(self, module, layer, slots_site, hidden, slots, routing, ctx, repeats=True):
        """The slots' probe replays on the round's probe rows (row-wise: each token's expert
        outputs depend on its own row), and those rows' routing index (R, k); ``repeats``:
        with the slots' repeats (else they come later: ``record``)."""
        spec = self.spec
        if not ctx.probed or not (spec.sigmas or spec.dc or spec.repeats):
            return [], None
        x = ctx.probe_rows(hidden)
        index = ctx.probe_rows(routing.index)[0]
        recorded = ctx.probe_rows(slots)
        # the zero identity's rows in the same call as the probe rows (one batched call of
        # the experts serves the gain, dc and zero probes): a per-call statistic (a range)
        # sees the real rows too
        zero = ((schema.KIND_ZERO, torch.zeros_like(x)),) if bias_free(module) else ()
        outputs, batched = run_probes(SlotReplay(module, index), (x,), {}, recorded,
                                      replace(spec, repeats=0), ctx.seeds(layer, slots_site),
                                      extra=zero)
        if zero and not batched:  # the copies ran one by one: the zero rows after the real
            both = slot_outputs(module, torch.cat([x, zero[0][1]], dim=-2),  # ones, one call
                                torch.cat([index, index]))
            outputs = [p if p.kind != schema.KIND_ZERO else
                       ProbeOutput(schema.KIND_ZERO, 0, 0.0, 0, both[..., x.shape[-2]:, :], None)
                       for p in outputs]
        # repeats are compared with the clean slots: they re-run the clean call's rows, so each
        # expert sees the same tokens (its GEMM's rounding depends on how many it gets)
        for t in range(spec.repeats if repeats else 0):
            again = slot_outputs(module, hidden, routing.index)
            outputs.append(ProbeOutput(schema.KIND_REPEAT, t, 0.0, 0,
                                       ctx.probe_rows(again), None))
        return outputs, index


class PendingSlots(NamedTuple):
    """A probed round's slots waiting for their repeats (shared_repeats.Waiting's parts)."""

    site: int  # the slots site
    x: torch.Tensor  # a copy of the experts call's hidden input
    again: Callable[[], torch.Tensor]  # a repeat of the slots call alone, at the probe rows
    outputs: list[ProbeOutput]  # the slots' probes but their repeats
    emit: Callable[[list[ProbeOutput]], None]  # every record of the call to the sink
    # a repeat of the slots from the experts call in a block's repeat (None: not given)
    repeat_from: Callable[[torch.Tensor], torch.Tensor | None]


def _same_call(out: torch.Tensor, recorded: torch.Tensor, clean: torch.Tensor
               ) -> torch.Tensor | None:
    """In a block's repeat the experts module was called on the recorded input and routing
    (shared_repeats checks the input): when its output is the recorded output bit for bit,
    the call reproduced itself, and a repeat of its slots (the same experts' GEMMs on the
    same tokens) is the clean slots; otherwise None (the slots are re-run alone)."""
    if out.numel() != recorded.numel() or out.dtype != recorded.dtype:
        return None
    return clean if bitwise_equal(out.reshape(recorded.shape), recorded) else None
