"""A fused experts call of a captured round (docs/dump-format.md, "Experts"): its routing, each
token slot's own expert output, and on the probe rows the slots' probe replays with the routing
held fixed, handed to the record sink (sinks.py: the tensors and the routing as records, or one
stats row per expert over the tokens routed to it)."""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
from torch import nn

from ..format import schema
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
            sys.stderr.write("srdd-dump: note: experts split over ranks (expert parallelism): "
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
               ctx: RoundContext) -> None:
        """A fused experts call of a captured round: its routing, then its slots' records
        (its replays run here: the caller holds its hooks off)."""
        found = routing_of(args, kwargs)
        if found is None:  # counted (site_errors, coverage) by the session
            raise TypeError(f"the routing arguments of {type(module).__name__} (token indices "
                            "and weights) were not found in its call")
        hidden, routing = found
        self.routing[id(module)] = routing
        if site not in self.sites:
            return
        slots_site, expert_sites = self.sites[site]
        logits = self.logits.pop(self.router_of.get(site, -1), None)
        if logits is not None and logits.numel() == hidden.shape[0] * logits.shape[-1]:
            margin = topk_margin(logits, routing.index).unsqueeze(-1)
        else:
            margin = torch.full((hidden.shape[0], 1), float("nan"), device=hidden.device)
        with torch.no_grad():
            slots = slot_outputs(module, hidden, routing.index)
            probes, rows_index = self._probes(module, layer, slots_site, hidden, slots,
                                              routing, ctx)
        self.sink.experts(ctx, layer, slots_site, expert_sites, slots, routing, margin,
                          probes, rows_index)

    def _probes(self, module, layer, slots_site, hidden, slots, routing, ctx):
        """The slots' probe replays on the round's probe rows (row-wise: each token's expert
        outputs depend on its own row), and those rows' routing index (R, k)."""
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
        for t in range(spec.repeats):
            again = slot_outputs(module, hidden, routing.index)
            outputs.append(ProbeOutput(schema.KIND_REPEAT, t, 0.0, 0,
                                       ctx.probe_rows(again), None))
        return outputs, index

