"""Where a round's records go: one record sink per ``--store``, picked once by the session.

A sink is told when a round opens, each clean output, each probe output, a fused experts call
and when a site's records of the round are complete. ``TensorSink`` (``sample:N``, ``full``)
keeps tensors; ``StatsSink`` (``stats[:R]``) reduces them on the device to one row of the
stats table per site (stats_store.py), plus R seeded rows of every block output. A new store
mode is one new class here and one branch in ``make_sink``.
"""

from __future__ import annotations

import numpy as np
import torch

from ..format import schema
from ..format.writer import Tensor
from .config import StoreSpec
from .experts import Routing, expert_rows
from .probes import ProbeOutput, ProbeSpec, probe_seed
from .reductions import ProbeRows
from .rounds import RoundContext, local_param
from .stats_store import StatsCollector
from .tensors import _TORCH_TO_LOGICAL, kept, to_host


class RecordSink:
    """The interface (and the parts every store shares)."""

    stat_columns: list[str] | None = None  # the dump's stats table, when the store has one

    def round_rows(self, probe_rows: np.ndarray | None, keep: np.ndarray | None, batch: int,
                   ntok: int, sample: int, step: int) -> np.ndarray | None:
        """The rows of a round that its row-subset records hold (``Round.probe_rows``)."""
        return probe_rows

    def open_round(self, ctx: RoundContext) -> None:
        """A round opens (``ctx.keep``: its rows, False at padding; None when all count)."""

    def clean(self, ctx: RoundContext, layer: int, site: int, hidden: torch.Tensor) -> None:
        raise NotImplementedError

    def probe(self, ctx: RoundContext, layer: int, site: int, rows: torch.Tensor, kind: int,
              probe: int = 0, param: float = 0.0, seed: int = 0, pert_rms: float = 0.0,
              subset: bool = True) -> None:
        """A probe output already cut to the rows it is stored on."""
        raise NotImplementedError

    def probe_outputs(self, ctx: RoundContext, layer: int, site: int,
                      outputs: list[ProbeOutput], rows: tuple | None = None) -> None:
        """Replay outputs as probe records. ``rows``: (positions, probe rows) to cut a call of
        the whole round to; None when the outputs hold only the probe rows already."""
        positions, probe_rows = rows if rows is not None else (None, None)
        # a module's own call (rows given) of flattened tokens: as the round's shape first
        shape = ctx.as_round if probe_rows is not None else (lambda t: t)
        for p in outputs:
            rms = 0.0
            if p.perturbation is not None:
                d = kept(shape(p.perturbation), positions, probe_rows).double()
                rms = float(d.pow(2).mean().sqrt())
            self.probe(ctx, layer, site, kept(shape(p.output), positions, probe_rows), p.kind,
                       p.probe, p.param, p.seed, rms)

    def experts(self, ctx: RoundContext, layer: int, slots_site: int,
                expert_sites: dict[int, int], slots: torch.Tensor, routing: Routing,
                margin: torch.Tensor, probes: list[ProbeOutput],
                rows_index: torch.Tensor | None) -> None:
        """A fused experts call: ``slots`` each token slot's own expert output, ``margin`` the
        router margin of each token, ``probes`` the slots' replays on the probe rows, whose
        routing index is ``rows_index``."""
        raise NotImplementedError

    def hold(self, ctx: RoundContext, layer: int, site: int) -> None:
        """The site's records will be finished later (its repeats come from its block's): keep
        copies of whatever of it is still the model's own tensor."""

    def finish_site(self, ctx: RoundContext, layer: int, site: int) -> None:
        """Every record of the site this round has been given."""

    def status(self) -> dict:
        return {}


class TensorSink(RecordSink):
    """``sample:N`` and ``full``: the tensors themselves."""

    def open_round(self, ctx: RoundContext) -> None:
        keep = ctx.keep
        if keep is not None:  # the excluded rows as a KIND_MASK record (docs/dump-format.md)
            array = keep.astype(np.float32).reshape(*keep.shape, 1)
            ctx.round.tensors.append(Tensor(layer=schema.STACK_INPUT, site=schema.BLOCK_SITE,
                                            array=array, dtype="float32",
                                            kind=schema.KIND_MASK))

    def clean(self, ctx: RoundContext, layer: int, site: int, hidden: torch.Tensor) -> None:
        array, logical = to_host(hidden, ctx.positions)
        ctx.round.tensors.append(Tensor(layer=layer, site=site, array=array, dtype=logical))

    def probe(self, ctx, layer, site, rows, kind, probe=0, param=0.0, seed=0, pert_rms=0.0,
              subset=True) -> None:
        array, logical = to_host(rows, None)
        ctx.round.tensors.append(Tensor(
            layer=layer, site=site, array=array, dtype=logical, kind=kind, probe=probe,
            param=float(param), seed=seed, pert_rms=pert_rms, subset=subset,
        ))

    def experts(self, ctx, layer, slots_site, expert_sites, slots, routing, margin, probes,
                rows_index) -> None:
        """The routing of every kept token (KIND_ROUTE: the k expert indices, their k weights,
        the router margin), the slots as a clean record, and the slots' probes."""
        route = torch.cat([routing.index.to(torch.float32), routing.weights.to(torch.float32),
                           margin.to(routing.weights.device, torch.float32)], dim=-1)
        self.clean(ctx, layer, slots_site, ctx.as_round(slots))
        array, _ = to_host(ctx.as_round(route), ctx.positions)
        ctx.round.tensors.append(Tensor(layer=layer, site=slots_site, array=array,
                                        dtype="float32", kind=schema.KIND_ROUTE))
        if probes:
            self.probe_outputs(ctx, layer, slots_site, probes)


class StatsSink(RecordSink):
    """``stats[:R]``: each site's outputs reduced on the device to its stats row, and R seeded
    rows of every block output (the baseline mode compares those). A serving engine's flat
    forward is reduced request by request (one collector each: ``ctx.segments``), each
    request's rows going to its own segment for ``rounds.split_round``."""

    def __init__(self, store: StoreSpec, spec: ProbeSpec, seed: int):
        self.collector = StatsCollector(
            schema.stat_columns(spec.sigmas, spec.draws, spec.dc, spec.repeats))
        self.stat_columns = self.collector.columns
        self._rows_kept, self._seed = store.rows, seed
        self._sample_rows: torch.Tensor | None = None
        self._columns = self.collector.columns
        # a flat forward's requests: (segment, its collector, which of ctx.rows are its own,
        # its kept rows as an index)
        self._parts: list[tuple] = []
        self._seconds = 0.0  # the per-request collectors' time

    def round_rows(self, probe_rows, keep, batch, ntok, sample, step) -> np.ndarray:
        """The seeded rows of every block output kept for the baseline mode, attended rows
        only while there are any (the same rows in a GPU and an NPU run of the same prompts
        and seed)."""
        n_rows = batch * ntok
        attended = np.ones(n_rows, dtype=bool) if keep is None else keep.reshape(-1)
        pool = np.flatnonzero(attended) if attended.any() else np.arange(n_rows)
        rng = np.random.default_rng(probe_seed(self._seed, sample, step, 0x5A3B1E))
        n = min(self._rows_kept, pool.size)
        return np.sort(rng.choice(pool, size=n, replace=False)) if n else pool[:0]

    def open_round(self, ctx: RoundContext) -> None:
        rows = ctx.round.probe_rows
        self._sample_rows = None if rows is None else torch.from_numpy(rows.astype(np.int64))
        self._parts = []
        if ctx.segments:
            self._open_parts(ctx)
            return
        self.collector.open_round(ctx.keep, ctx.round.positions, ctx.round.batch, ctx.rows,
                                  ctx.round.token_ids)

    def _open_parts(self, ctx: RoundContext) -> None:
        flat_rows = None if ctx.rows is None else ctx.rows.numpy()
        ids = ctx.round.token_ids
        ids = None if ids is None else np.asarray(ids).reshape(-1)
        for seg in ctx.segments:
            kept = seg.kept_rows()
            collector = StatsCollector(self._columns)
            mine = local = None
            if flat_rows is not None:
                mine, local = seg.own(flat_rows)
            collector.open_round(None, np.asarray(seg.positions)[kept - seg.start], 1,
                                 torch.from_numpy(local) if local is not None and local.size
                                 else None,
                                 None if ids is None or kept.size == 0 or
                                 int(kept.max()) >= ids.size else ids[kept])
            self._parts.append((seg, collector, mine, torch.from_numpy(kept)))

    def hold(self, ctx: RoundContext, layer: int, site: int) -> None:
        self.collector.hold(layer, site)  # a flat forward's parts hold copies already

    def clean(self, ctx: RoundContext, layer: int, site: int, hidden: torch.Tensor) -> None:
        t = kept(hidden, ctx.positions)
        if self._parts:
            flat = t.reshape(-1, t.shape[-1])
            for _, collector, _, rows in self._parts:
                collector.clean(layer, site, flat.index_select(0, rows.to(flat.device))
                                .unsqueeze(0), _logical(t.dtype))
        else:
            self.collector.clean(layer, site, t, _logical(t.dtype))
        if site == schema.BLOCK_SITE and self._sample_rows is not None \
                and self._sample_rows.numel():
            array, logical = to_host(hidden, ctx.positions, self._sample_rows)
            ctx.round.tensors.append(Tensor(layer=layer, site=site, array=array,
                                            dtype=logical, subset=True))

    def probe(self, ctx, layer, site, rows, kind, probe=0, param=0.0, seed=0, pert_rms=0.0,
              subset=True) -> None:
        data = rows.detach().reshape(-1, rows.shape[-1])
        if not self._parts:
            self.collector.probe(layer, site, ProbeRows(schema.KIND_NAMES[kind], float(param),
                                                        int(probe), float(pert_rms), data,
                                                        subset))
            return
        for seg, collector, mine, _ in self._parts:
            local = local_param(kind, float(param), seg)
            if mine is not None and mine.any() and data.shape[0] == mine.size \
                    and local is not None:
                index = torch.from_numpy(np.flatnonzero(mine)).to(data.device)
                collector.probe(layer, site, ProbeRows(
                    schema.KIND_NAMES[kind], local, int(probe), float(pert_rms),
                    data.index_select(0, index), subset))

    def experts(self, ctx, layer, slots_site, expert_sites, slots, routing, margin, probes,
                rows_index) -> None:
        """Each expert's rows of this call, reduced to its stats row."""
        kept_slots = kept(ctx.as_round(slots), ctx.positions)
        kept_index = kept(ctx.as_round(routing.index), ctx.positions)
        width = kept_slots.shape[-1] // max(1, routing.index.shape[-1])
        flat_slots = kept_slots.reshape(-1, kept_slots.shape[-1])
        flat_index = kept_index.reshape(-1, kept_index.shape[-1])
        flat_margin = kept(ctx.as_round(margin), ctx.positions).reshape(-1)
        valid = self.collector.round_valid()
        dtype = _logical(slots.dtype)
        for expert, site in expert_sites.items():
            rows, routed = expert_rows(flat_slots, flat_index, expert)
            if not bool(routed.any()):
                continue
            self.collector.clean(layer, site, rows.reshape(*kept_slots.shape[:-1], width),
                                 dtype, valid=routed)
            mine = routed if valid is None else routed & valid.to(routed.device)
            margins = flat_margin[mine]
            margins = margins[torch.isfinite(margins)]
            if margins.numel():
                # numpy's median (the mean of the middle two), as the full store's reader
                self.collector.extra(layer, site, {
                    "topk_margin": float(torch.quantile(margins.double(), 0.5))})
            for p in probes:
                data = p.output.reshape(-1, p.output.shape[-1])
                mine, _ = expert_rows(data, rows_index, expert)
                rms = 0.0
                if p.perturbation is not None:
                    rms = float(p.perturbation.double().pow(2).mean().sqrt())
                self.collector.probe(layer, site, ProbeRows(
                    schema.KIND_NAMES[p.kind], float(p.param), int(p.probe), rms, mine))
            self.finish_site(ctx, layer, site)

    def finish_site(self, ctx: RoundContext, layer: int, site: int) -> None:
        for seg, collector, _, _ in self._parts:
            row = collector.finish(layer, site)
            if row is not None:
                seg.stats.append(row)
            self._seconds += collector.seconds
            collector.seconds = 0.0
        if self._parts:
            return
        row = self.collector.finish(layer, site)
        if row is not None:
            ctx.round.stats.append(row)

    def status(self) -> dict:
        return {"stats_seconds": round(self.collector.seconds + self._seconds, 3)}


def make_sink(store: StoreSpec, spec: ProbeSpec, seed: int) -> RecordSink:
    """The sink of a ``--store`` (``config.parse_store``)."""
    if store.kind == "stats":
        return StatsSink(store, spec, seed)
    return TensorSink()


def _logical(dtype: torch.dtype) -> str:
    return _TORCH_TO_LOGICAL.get(dtype, "float32")
