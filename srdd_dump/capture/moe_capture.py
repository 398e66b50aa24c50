"""What a capture session records of a fused experts call (docs/dump-format.md, "Experts").

Full store: at the experts' ``slots`` site, the routing of every kept token (KIND_ROUTE:
the k expert indices, then their k weights) and every token slot's own expert output
(clean, width k * H), and on the probe rows the slots' probe replays with the routing held
fixed. Stats store: one row per expert, reduced over the tokens routed to it, with its probe
replays on the probe rows routed to it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..format import schema
from ..format.writer import Tensor
from .discovery import EXPERT, EXPERT_SLOTS, EXPERTS, ROUTER
from .experts import (
    Routing,
    SlotReplay,
    bias_free,
    expert_rows,
    pinned_routing,
    routing_of,
    slot_outputs,
    topk_margin,
)
from .probes import ProbeOutput, run_probes
from .reductions import ProbeRows
from .tensors import _TORCH_TO_LOGICAL, kept, to_host


class ExpertCapture:
    """The slots and per-expert records of every fused experts module of one session."""

    def __init__(self, session: Any):  # the hooks.CaptureSession it belongs to
        self.s = session
        sites = session.sites
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

    def open_round(self) -> None:
        self.logits.clear()
        self.routing.clear()

    def pinned(self):
        """Routing held at this round's for a replay of a block or sub-block."""
        return pinned_routing(self.modules, self.routing)

    def router_output(self, module: nn.Module, logits: torch.Tensor) -> None:
        self.logits[id(module)] = logits

    def record(self, module: nn.Module, layer: int, site: int, args: tuple, kwargs: dict
               ) -> None:
        """A fused experts call of a captured round: its routing, then its slots' records."""
        found = routing_of(args, kwargs)
        if found is None:  # counted (site_errors, coverage) by the session
            raise TypeError(f"the routing arguments of {type(module).__name__} (token indices "
                            "and weights) were not found in its call")
        hidden, routing = found
        self.routing[id(module)] = routing
        if site not in self.sites:
            return
        s = self.s
        slots_site, expert_sites = self.sites[site]
        logits = self.logits.pop(self.router_of.get(site, -1), None)
        if logits is not None and logits.numel() == hidden.shape[0] * logits.shape[-1]:
            margin = topk_margin(logits, routing.index).unsqueeze(-1)
        else:
            margin = torch.full((hidden.shape[0], 1), float("nan"), device=hidden.device)
        s._replaying = True
        try:
            with torch.no_grad():
                slots = slot_outputs(module, hidden, routing.index)
                probes, rows_index = self._probes(module, layer, slots_site, hidden, slots,
                                                  routing)
        finally:
            s._replaying = False
        if s._stats is not None:
            self._reduce(layer, expert_sites, slots, routing, probes, rows_index, margin)
            return
        route = torch.cat([routing.index.to(torch.float32), routing.weights.to(torch.float32),
                           margin.to(routing.weights.device, torch.float32)], dim=-1)
        s._add(layer, slots_site, s._as_round(slots))
        array, _ = to_host(s._as_round(route), s._positions)
        s._round.tensors.append(Tensor(layer=layer, site=slots_site, array=array,
                                       dtype="float32", kind=schema.KIND_ROUTE))
        if probes:
            s._add_probes(layer, slots_site, probes, None, None)

    def _probes(self, module, layer, slots_site, hidden, slots, routing):
        """The slots' probe replays on the round's probe rows (row-wise: each token's expert
        outputs depend on its own row), and those rows' routing index (R, k)."""
        s = self.s
        if s._rows is None:
            return [], None
        spec = s.probe_spec
        if not (spec.sigmas or spec.dc or spec.repeats):
            return [], None
        x = kept(s._as_round(hidden), s._positions, s._rows)
        index = kept(s._as_round(routing.index), s._positions, s._rows)[0]
        recorded = kept(s._as_round(slots), s._positions, s._rows)
        outputs, _ = run_probes(SlotReplay(module, index), (x,), {}, recorded,
                                replace(spec, repeats=0), s._seeds(layer, slots_site))
        # repeats are compared with the clean slots: they re-run the clean call's rows, so each
        # expert sees the same tokens (its GEMM's rounding depends on how many it gets)
        for t in range(spec.repeats):
            again = slot_outputs(module, hidden, routing.index)
            outputs.append(ProbeOutput(schema.KIND_REPEAT, t, 0.0, 0,
                                       kept(s._as_round(again), s._positions, s._rows), None))
        if bias_free(module):
            # zero rows in the same call as the probe rows: a per-call statistic (a range)
            # sees the real rows too
            both = slot_outputs(module, torch.cat([x, torch.zeros_like(x)], dim=-2),
                                torch.cat([index, index]))
            zero = both[..., x.shape[-2]:, :]
            outputs.append(ProbeOutput(schema.KIND_ZERO, 0, 0.0, 0, zero, None))
        return outputs, index

    def _reduce(self, layer, expert_sites, slots, routing, probes, rows_index, margin) -> None:
        """--store stats: each expert's rows of this call, reduced to its stats row."""
        s = self.s
        kept_slots = kept(s._as_round(slots), s._positions)
        kept_index = kept(s._as_round(routing.index), s._positions)
        width = kept_slots.shape[-1] // max(1, routing.index.shape[-1])
        flat_slots = kept_slots.reshape(-1, kept_slots.shape[-1])
        flat_index = kept_index.reshape(-1, kept_index.shape[-1])
        flat_margin = kept(s._as_round(margin), s._positions).reshape(-1)
        valid = s._stats.round_valid()
        dtype = _logical(slots.dtype)
        for expert, site in expert_sites.items():
            rows, routed = expert_rows(flat_slots, flat_index, expert)
            if not bool(routed.any()):
                continue
            s._stats.clean(layer, site, rows.reshape(*kept_slots.shape[:-1], width), dtype,
                           valid=routed)
            mine = routed if valid is None else routed & valid.to(routed.device)
            margins = flat_margin[mine]
            margins = margins[torch.isfinite(margins)]
            if margins.numel():
                # numpy's median (the mean of the middle two), as the full store's reader
                s._stats.extra(layer, site,
                               {"topk_margin": float(torch.quantile(margins.double(), 0.5))})
            for p in probes:
                data = p.output.reshape(-1, p.output.shape[-1])
                mine, _ = expert_rows(data, rows_index, expert)
                rms = 0.0
                if p.perturbation is not None:
                    rms = float(p.perturbation.double().pow(2).mean().sqrt())
                s._stats.probe(layer, site, ProbeRows(schema.KIND_NAMES[p.kind],
                                                      float(p.param), int(p.probe), rms, mine))
            s._finish_site(layer, site)


def _logical(dtype: torch.dtype) -> str:
    return _TORCH_TO_LOGICAL.get(dtype, "float32")
