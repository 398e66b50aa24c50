"""Per-layer reference-free signals: clean statistics and probe responses. Arrays in, a typed
``Signals`` out; no files, no processes.

Every signal is computed per round and then aggregated over the rounds with a median (typical
value) or a max (evidence that appears in any round); see docs/method.md. Prefill rounds and
decode steps are accumulated apart (``phase``): a decode kernel has signals of its own.
``LayerSignals`` accumulates one (layer, site) over the rounds of a dump, in file order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import numpy as np

from ..vocabulary import DC_LOW, EXPERT, LOW_BITS_MASK, LOWBITS_BY_VALUE
from . import array_stats as st
from .identities import (
    causal_check,
    channel_distance,
    relative_distance,
    scale_check,
    zero_check,
    zeros_explained,
)
from .moments import BLOCK as MOMENTS_BLOCK
from .moments import Moments
from .sums import total
from .tolerance import UNIT_ROUNDOFF

BLOCK_SITE = -1  # Signals.site of a block's own output (the dump schema's BLOCK_SITE)
PREFILL = "prefill"  # rounds of more than one token per sequence
DECODE = "decode"  # one-token rounds after a prefill (other kernels on most devices)
# Low mantissa bits that a value of each dtype rarely has all zero (healthy rate 2^-bits): fp32
# 13 (fp16-precision values: 10 of fp32's 23 mantissa bits; bf16's 7 leave them 0 too), bf16
# 4 (fp8 e4m3 precision: 3 mantissa bits of bf16's 7), fp16 3 (bf16 precision: 7 of fp16's
# 10). Masks on the float32 bits the reader gives back.
LOW_BITS = {"float32": 13, "bfloat16": 4, "float16": 3}


class Probe(NamedTuple):
    """One probe replay of a module on its recorded input, as token rows."""

    kind: str  # "gain" (noise of rms pert_rms added), "dc" (constant shift), "repeat",
    # "replay", "scale" (k), "causal" (cut position), "host" (float64 host replay)
    param: float  # gain: sigma relative to each token's std; dc: shift in token stds
    pert_rms: float  # rms of the perturbation added to the input (gain)
    data: np.ndarray  # the module's output on the perturbed input, (rows, width)
    subset: bool = True  # rows are the round's probe rows (False: every kept row)


@dataclass
class Signals:
    layer: int
    site: int  # schema.BLOCK_SITE or an index into the dump's sites
    module: str
    samples: int = 0
    probed_samples: int = 0  # of those, the samples whose rounds carried probe responses
    phase: str = PREFILL  # PREFILL or DECODE: the rounds these signals come from
    dtype: str = ""  # logical dtype of its clean records, the less precise if they differ
    # clean statistics over every captured round
    mean: float = float("nan")
    std: float = float("nan")
    absmax: float = float("nan")
    kurtosis: float = float("nan")
    kurt_change: float = float("nan")  # blocks: log((kurtosis_k + 3) / (kurtosis_{k-1} + 3))
    zero_frac: float = float("nan")
    n_values: int = 0  # clean values behind the fractions above (their sample size)
    nan_count: int = 0
    inf_count: int = 0
    # shape of the clean output
    pileup: float = float("nan")  # histogram edge bin / its inner neighbours, worse side
    ties: float = float("nan")  # tokens sharing a channel's exact max or min, worst channel
    tie_excess: float = float("nan")  # those tokens / the count at the next values inward
    update_rms: float = float("nan")  # RMS of what the module adds (block: h_k - h_{k-1})
    offset: float = float("nan")  # |mean(update)| / st.rms(update)
    # the offset a mean of that many random values reaches by chance: 1/sqrt(values of a
    # round), median over rounds, over sqrt(rounds) (the noise floor of the relative z)
    offset_noise: float = float("nan")
    dc_energy: float = float("nan")  # ||token-mean of update||^2 / mean ||update row||^2
    consistency: float = float("nan")  # 99th pct over channels of |mean_t u_c| / rms_t u_c
    stuck: float = float("nan")  # fraction of channels at one non-zero value over all tokens
    lowbits: float = float("nan")  # non-zero values whose LOW_BITS[dtype] low mantissa bits are 0
    grid: float = float("nan")  # tested rows whose values lie on an 8-bit grid (median)
    # probe responses (NaN when the dump has no probes)
    gain: float = float("nan")  # median st.std(dO)/st.rms(dI) at the largest sigma
    gain_spread: float = float("nan")  # robust spread of that gain over samples and draws
    gain_small: float = float("nan")  # the same at the smallest sigma
    linearity: float = float("nan")  # gain_small / gain
    dc_dead: float = float("nan")  # fraction of elements whose dc response is exactly 0
    flat_zero: float = float("nan")  # fraction unmoved by dc and every top-sigma gain draw, =0
    flat_value: float = float("nan")  # ... the same with a non-zero value (clipped)
    dc_low: float = float("nan")  # fraction with |dc response| < 0.15 x its median
    n_probed: int = 0  # values judged by the probes in a round (median): their sample size
    instability: float = float("nan")  # max st.rms(repeat - clean) / st.rms(clean)
    instab_changed: float = float("nan")  # fraction of elements a repeat changed (max)
    instab_kurtosis: float = float("nan")  # excess kurtosis of (repeat - clean) differences
    # batched replays: the in-batch reference vs the clean output of the same input
    batch_dep: float = float("nan")  # max |replay - clean| / max |clean|, worst sample
    batch_dep_level: float = float("nan")  # median |clean| / max |clean| where it moved most
    batch_dep_moved: float = float("nan")  # fraction of elements moved by >= half that max
    width: int = 0  # values per token row of its clean records (0: unknown)
    # exact identities and the host reference (NaN when not probed)
    role: str = ""  # the site's role in the dump (linear, norm, act, core, rotary, sublayer)
    scale_broken: float = float("nan")  # linear: elements breaking y(2^k x) = 2^k y(x), worst
    scale_n: int = 0  # elements judged in that round
    scale_pattern: str = ""  # zero / clip / offset / other (identities.scale_pattern)
    scale_size: float = float("nan")  # rms of those differences / rms of the output
    causal_broken: float = float("nan")  # elements before the cut moved by later tokens, worst
    causal_n: int = 0
    causal_size: float = float("nan")  # rms of those moves / rms of the output
    host_red: float = float("nan")  # relative distance to the float64 host replay, worst round
    host_channel_red: float = float("nan")  # the same for the worst channel (identities)
    # the share of the device's exact zeros (probe rows) the float64 host replay makes too (to
    # the dtype's rounding of the row): zeros of the computation itself (a saturated GELU
    # tail, a norm channel whose weight is 0), not a dead zone; the worst round
    host_zeros: float = float("nan")
    # mixture of experts: token rows routed to an expert over every round, and the median
    # router margin of those tokens (docs/method.md, "Experts")
    tokens: float = float("nan")
    topk_margin: float = float("nan")

    def as_dict(self) -> dict:
        # every field is a number or a string: no deep copy (dataclasses.asdict's recursion
        # cost 0.2 ms a row, 60 ms of a report of 300 rows)
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class RoundStats:
    """The reductions of one (layer, site) in one round: everything ``LayerSignals`` keeps of
    the round's arrays. ``round_stats`` computes them from arrays (the full store); a stats
    dump (``--store stats``) holds them as computed on the device by the same arithmetic."""

    sample: int
    dtype: str
    moments: Moments
    pileup: float = float("nan")
    ties: float = float("nan")
    tie_excess: float = float("nan")
    update_rms: float = float("nan")
    offset: float = float("nan")
    dc_energy: float = float("nan")
    consistency: float = float("nan")
    stuck: float = float("nan")
    lowbits: float = float("nan")
    rows: float = float("nan")  # token rows seen (after the attention mask)
    # the values of its distinct rows: what a chance mean is of (the beams of a beam search,
    # one prompt's copies, repeat its rows; NaN: as many as the moments count)
    distinct: float = float("nan")
    grid: float = float("nan")  # tested rows on an 8-bit grid (array_stats.grid_rows)
    topk_margin: float = float("nan")  # an expert: median router margin of its tokens
    batch_dep: tuple[float, float, float] | None = None
    gains: list[tuple[float, float]] = field(default_factory=list)  # (sigma, std(dO)/rms(dI))
    # per dc probe: (dead, flat_zero, flat_value, probed, low) (the Signals fields)
    dc: list[tuple[float, float, float, int, float]] = field(default_factory=list)
    repeats: list[tuple[float, float]] = field(default_factory=list)  # (instability, changed)
    diffs: Moments | None = None  # moments of the repeats' differences (changed repeats)
    scale: tuple[float, int, str, float] | None = None  # worst k: (broken frac, judged, ...)
    causal: list[tuple[float, int, float]] = field(default_factory=list)
    host: tuple[float, float] | None = None  # (relative distance, worst channel's)
    host_zeros: float = float("nan")  # share of the device's exact zeros the host makes too


def round_stats(
    x: np.ndarray, dtype: str, sample: int, before: np.ndarray | None = None,
    rows: np.ndarray | None = None, probes: list[Probe] = (), valid: np.ndarray | None = None,
    positions: np.ndarray | None = None, ids: np.ndarray | None = None,
) -> RoundStats | None:
    """The reductions of one clean record ``x`` (batch, ntok, width) and its probes; None when
    the attention mask leaves no row. ``before``: the previous block's clean output in the
    same round; ``rows``: the round's probe rows (indices into the token rows of ``x``);
    ``probes``: this module's probe replays of the round; ``valid``: per token row of ``x``,
    False for rows the attention mask excludes (padding), which no statistic sees;
    ``positions``: the token position of each token row of ``x``; ``ids``: its token id."""
    n_rows = x.size // x.shape[-1] if x.ndim else 0
    if ids is not None and ids.size != n_rows:
        ids = None
    if valid is not None and valid.size == n_rows and not valid.all():
        if positions is not None and positions.size == valid.size:
            positions = positions[valid]
        if ids is not None:
            ids = ids.reshape(-1)[valid]
        x, before, rows, probes = _valid_rows(x, before, rows, probes, valid)
        if not x.size:
            return None
    # the channels' extremes first: they prove the record finite and give its range to the
    # moments and the pile-up, and they are the distinct rows' extremes too (the same values),
    # which the tie count and the stuck channels use
    x_rows = st.rows_of(x)
    extremes = st.channel_extremes(x_rows) if x.size else None
    bounds = (extremes[1].min(), extremes[0].max()) if extremes is not None else None
    # NaN propagates through max and min, an Inf is one of them: finite extremes, finite record
    all_finite = bounds is None or bool(np.isfinite(bounds[0]) & np.isfinite(bounds[1]))
    # a record with no previous block's output to subtract is its own update: its float64
    # rows serve the moments and the update's statistics (one conversion, one sum)
    own_update = before is None or before.shape != x.shape
    wide = x_rows.astype(np.float64) if all_finite and own_update and \
        x.size <= MOMENTS_BLOCK else None
    moments = Moments().add(x, bounds, wide)
    out = RoundStats(sample=sample, dtype=dtype, moments=moments)
    out.rows = float(x.size // x.shape[-1]) if x.ndim else 0.0
    fin = None if all_finite else np.isfinite(x)
    finite = x.reshape(-1) if all_finite else x[fin]
    out.pileup = st.pileup(x_rows, extremes=extremes) if all_finite else st.pileup(finite)
    keep = st.unique_index(x_rows)
    distinct = x_rows if keep is None else x_rows[keep]
    out.distinct = float(distinct.size)
    extremes = extremes if all_finite else None
    ids = None if ids is None else ids.reshape(-1)
    if all_finite:
        out.ties, out.tie_excess = st.ties(
            distinct, distinct=True, extremes=extremes,
            ids=ids if ids is None or keep is None else ids[keep])
    else:
        out.ties, out.tie_excess = st.ties(st.rows_of(np.where(fin, x, 0.0)), ids=ids)
    update, fin_u, upd_finite = x, fin, all_finite
    if not own_update:
        update = x - before
        fin_u = np.isfinite(update)
        upd_finite = bool(fin_u.all())
    u = wide if wide is not None else \
        st.rows_of(update if upd_finite else np.where(fin_u, update, 0.0)).astype(np.float64)
    if upd_finite:  # the usual case: the float64 rows are every value, converted once
        flat = u.reshape(-1)
        out.update_rms = upd_rms = st.rms64(flat)
        if wide is not None and bounds[0] != bounds[1]:
            mean = moments.mean_  # the same sum of the same rows (a constant's is its value)
        else:
            mean = total(flat) / flat.size if flat.size else float("nan")
    else:
        upd = update[fin_u]
        out.update_rms = upd_rms = st.rms(upd)
        mean = float(upd.mean(dtype=np.float64)) if upd.size else float("nan")
    out.offset = abs(mean) / upd_rms if upd_rms > 0 else float("nan")
    out.dc_energy, out.consistency, out.stuck = st.channel_signals(u, distinct, distinct=True,
                                                                   extremes=extremes)
    mask = LOW_BITS_MASK.get(dtype)
    if mask is not None and finite.dtype == np.float32:
        nnz = finite.size - moments.zeros  # the moments counted the finite zeros (+-0.0)
        if nnz:
            # a zero's low bits are 0 (the masks leave the sign bit out): every zero is "low"
            low = finite.size - np.count_nonzero(finite.view(np.uint32) & np.uint32(mask))
            out.lowbits = (low - moments.zeros) / nnz
            if out.lowbits > LOWBITS_BY_VALUE:
                out.lowbits = st.lowbits_by_value(finite, mask)
    out.grid = st.grid_rows(x_rows, dtype)
    if rows is not None and probes:
        if rows.size and int(rows.max()) >= x.size // x.shape[-1]:
            rows = rows[:0]  # a model-level operator (rotary) has fewer rows than the round
        row_pos = positions[rows] if positions is not None and rows.size and \
            positions.size > int(rows.max()) else None
        _identities(out, x_rows, rows, row_pos, probes, dtype)
        _probes(out, x_rows[rows], probes)
    return out


def _identities(out: RoundStats, x_rows: np.ndarray, rows: np.ndarray,
                row_pos: np.ndarray | None, probes: list[Probe], dtype: str) -> None:
    """The scale and causality identities and the host replay of one round."""
    scaled = {int(p.param): st.rows_of(p.data) for p in probes if p.kind == "scale"}
    if 0 in scaled:
        worst = (0.0, 0, "", 0.0)
        for k, data in scaled.items():
            if k:
                check = scale_check(scaled[0], data, k, dtype)
                frac = check.broken / check.judged if check.judged else 0.0
                if check.judged and (frac > worst[0] or not worst[1]):
                    worst = (frac, check.judged, check.pattern, check.size)
        if worst[1]:
            out.scale = worst
    for p in probes:
        if p.kind == "zero":  # an expert's zero identity: held in the scale fields
            check = zero_check(st.rows_of(p.data), x_rows[rows])
            out.scale = (check.broken / check.judged if check.judged else 0.0, check.judged,
                         check.pattern, check.size)
    # unperturbed runs of the same rows: the in-batch copy, the repeats and the recorded
    # output; a row's last bits may depend on its place in the batch, so the closest one is
    # the causality copy's reference
    refs = []
    if row_pos is not None and any(p.kind == "causal" for p in probes):
        refs = [st.rows_of(p.data) for p in probes if p.kind in ("replay", "repeat")]
        refs.append(x_rows[rows])
    for p in probes:
        if p.kind == "causal" and row_pos is not None:
            out_rows = st.rows_of(p.data)
            checks = [causal_check(ref, out_rows, row_pos, int(p.param))
                      for ref in refs if ref.shape == out_rows.shape]
            moved, judged, size = min(checks, default=(0, 0, 0.0))
            if judged:
                out.causal.append((moved / judged, judged, size))
        elif p.kind == "host":
            device = x_rows[rows] if p.subset else x_rows
            out.host = (relative_distance(device, st.rows_of(p.data)),
                        channel_distance(device, st.rows_of(p.data)))
            out.host_zeros = zeros_explained(device, st.rows_of(p.data), dtype)


def _probes(out: RoundStats, clean_rows: np.ndarray, probes: list[Probe]) -> None:
    refs = [p.data for p in probes if p.kind == "replay"]
    ref = st.rows_of(refs[0]) if refs else clean_rows
    if refs and ref.shape == clean_rows.shape:
        out.batch_dep = st.batch_dependence(ref, clean_rows)
    top_sigma = max((float(p.param) for p in probes if p.kind == "gain"), default=0.0)
    top_sigma = max(top_sigma, 0.0)
    # gain draws that added nothing (every probe row's std was 0: an input of zeros or of
    # one constant) mean the dc shift, also in row stds, added nothing: no flat element is
    # the module's
    gains = [p for p in probes if p.kind == "gain"]
    null = bool(gains) and all(p.pert_rms == 0 for p in gains)
    flat = np.ones(clean_rows.shape, dtype=bool)
    for p in probes:
        if p.kind == "gain" and p.pert_rms > 0:
            d = st.rows_of(p.data) - ref
            out.gains.append((float(p.param), st.std(d) / p.pert_rms))
            if p.param == top_sigma:
                flat &= d == 0
    for p in probes:
        if p.kind != "dc" or null:
            continue
        d = np.abs(st.rows_of(p.data) - ref)
        ok = np.isfinite(d)
        all_ok = bool(ok.all())
        if not (all_ok or ok.any()):
            continue
        dead = d == 0
        flat &= dead
        ref_zero = ref == 0
        # flat under every perturbation: 0 -> dead zone; non-zero and where a clip limit puts
        # values -> clipped (a value a coarse rounding grid leaves unmoved sits anywhere)
        clipped = flat & ~ref_zero
        if clipped.any():  # the usual case: no flat non-zero element, nothing to test
            clipped &= st.at_clip_limit(ref)
        if all_ok:
            d_ok, fractions = d.reshape(-1), (dead, flat & ref_zero, clipped)
        else:
            d_ok = d[ok]
            fractions = (dead[ok], (flat & ref_zero)[ok], clipped[ok])
        med = st.median(d_ok)
        low = st.fraction(d_ok < DC_LOW * med) if med > 0 else 1.0
        out.dc.append((*(st.fraction(f) for f in fractions), d_ok.size, low))
    repeats = [p for p in probes if p.kind == "repeat"]
    diffs: list[np.ndarray] = []
    if not repeats:
        return
    scale = st.rms(clean_rows)
    for p in repeats:
        d = st.rows_of(p.data) - clean_rows
        fin = np.isfinite(d)
        if not fin.all():
            d = np.where(fin, d, 0.0)
        nz = d != 0
        changed = np.count_nonzero(nz)
        # the usual case: the repeat is bit-identical, its rms is 0
        d_rms = st.rms(d) if changed or not d.size else 0.0
        out.repeats.append((d_rms / scale if scale > 0 else float("nan"),
                            changed / nz.size if nz.size else float("nan")))
        if changed:
            diffs.append(d.reshape(-1))
    if diffs:
        out.diffs = Moments().add(np.concatenate(diffs))


class LayerSignals:
    """Accumulates the signals of one (layer, site) over the rounds, in file order."""

    def __init__(self, layer: int, site: int, module: str, phase: str = PREFILL,
                 role: str = ""):
        self.sig = Signals(layer=layer, site=site, module=module, phase=phase, role=role)
        self.scale: list[tuple[float, int, str, float]] = []
        self.causal: list[tuple[float, int, float]] = []
        self.host: list[float] = []
        self.host_zeros: list[float] = []
        self.host_channel: list[float] = []
        self.moments = Moments()
        self.samples: set[int] = set()
        self.probed_samples: set[int] = set()
        self.per_sample: dict[str, list[float]] = {
            k: [] for k in ("pileup", "ties", "tie_excess", "offset", "upd", "dce", "cons",
                            "stuck", "lowbits", "rows", "margin", "grid", "noise")
        }
        self.gains: dict[float, list[float]] = {}
        self.dc_dead: list[float] = []
        self.dc_low: list[float] = []
        self.flat_zero: list[float] = []
        self.flat_value: list[float] = []
        self.probed: list[int] = []
        self.instab: list[float] = []
        self.changed: list[float] = []
        self.batch_dep: list[tuple[float, float, float]] = []
        self.width = 0
        self.diffs = Moments()
        self.any_diffs = False
        self.dtypes: dict[str, int] = {}  # logical dtype -> elements seen

    def add(
        self, x: np.ndarray, dtype: str, sample: int, before: np.ndarray | None,
        rows: np.ndarray | None, probes: list[Probe], valid: np.ndarray | None = None,
        positions: np.ndarray | None = None, topk_margin: float = float("nan"),
        ids: np.ndarray | None = None,
    ) -> None:
        """One clean record and its probes (the arguments of ``round_stats``); an expert's
        ``topk_margin`` of the round."""
        stats = round_stats(x, dtype, sample, before, rows, probes, valid, positions, ids)
        if stats is not None:
            stats.topk_margin = topk_margin
            self.add_round(stats)

    def add_round(self, r: RoundStats) -> None:
        """The reductions of one round, from arrays or from a stats dump."""
        self.moments.merge(r.moments)
        self.samples.add(r.sample)
        if r.gains or r.dc or r.repeats:
            self.probed_samples.add(r.sample)
        self.dtypes[r.dtype] = self.dtypes.get(r.dtype, 0) + r.moments.total
        acc = self.per_sample
        for key, value in (("pileup", r.pileup), ("ties", r.ties), ("tie_excess", r.tie_excess),
                           ("upd", r.update_rms), ("offset", r.offset), ("dce", r.dc_energy),
                           ("cons", r.consistency), ("stuck", r.stuck),
                           ("lowbits", r.lowbits), ("rows", r.rows), ("grid", r.grid),
                           ("margin", r.topk_margin),
                           ("noise", _offset_noise(r.moments.count if math.isnan(r.distinct)
                                                   else min(r.moments.count, r.distinct)))):
            acc[key].append(value)
        if r.scale is not None:
            self.scale.append(r.scale)
        self.causal += r.causal
        if r.host is not None:
            self.host.append(r.host[0])
            self.host_channel.append(r.host[1])
        if np.isfinite(r.host_zeros):
            self.host_zeros.append(r.host_zeros)
        if r.batch_dep is not None:
            self.batch_dep.append(r.batch_dep)
        if r.rows > 0 and r.moments.count > 0:
            self.width = max(self.width, round(r.moments.count / r.rows))
        for sigma, gain in r.gains:
            self.gains.setdefault(sigma, []).append(gain)
        for dead, flat_zero, flat_value, probed, low in r.dc:
            self.dc_dead.append(dead)
            self.flat_zero.append(flat_zero)
            self.flat_value.append(flat_value)
            self.probed.append(probed)
            self.dc_low.append(low)
        for instab, changed in r.repeats:
            self.instab.append(instab)
            self.changed.append(changed)
        if r.diffs is not None:
            self.diffs.merge(r.diffs)
            self.any_diffs = True

    def result(self) -> Signals:
        sig = self.sig
        if not self.samples:
            return sig
        moments, acc, med = self.moments, self.per_sample, st.nanmedian
        sig.samples = len(self.samples)
        sig.probed_samples = len(self.probed_samples)
        sig.mean, sig.std, sig.absmax = moments.mean, moments.std, float(moments.absmax)
        sig.kurtosis, sig.zero_frac = moments.kurtosis, moments.zero_frac
        sig.n_values = int(moments.count)
        sig.nan_count, sig.inf_count = int(moments.nan_count), int(moments.inf_count)
        sig.pileup = st.nanmax(acc["pileup"])
        if self.sig.role == EXPERT:
            rows = np.asarray(acc["rows"], dtype=np.float64)
            sig.tokens = float(np.nansum(rows)) if np.isfinite(rows).any() else float("nan")
            sig.topk_margin = med(acc["margin"])
        sig.ties = st.nanmax(acc["ties"])
        sig.tie_excess = st.nanmax(acc["tie_excess"])
        # a module that ran in two dtypes (the model cast between samples) is judged by the
        # less precise: its higher-precision rounds then meet looser limits, never the reverse
        sig.dtype = max(self.dtypes, key=lambda d: UNIT_ROUNDOFF.get(d, 0.0))
        sig.update_rms = med(acc["upd"])
        sig.offset = med(acc["offset"])
        rounds = int(np.isfinite(np.asarray(acc["offset"], dtype=np.float64)).sum())
        if rounds:  # the rounds the offset is the median of
            sig.offset_noise = med(acc["noise"]) / math.sqrt(rounds)
        sig.dc_energy = med(acc["dce"])
        sig.consistency = med(acc["cons"])
        sig.stuck = st.nanmax(acc["stuck"])
        sig.lowbits = med(acc["lowbits"])
        sig.grid = med(acc["grid"])
        if self.gains:
            big, small = max(self.gains), min(self.gains)
            sig.gain = med(self.gains[big])
            sig.gain_spread = st.mad(self.gains[big])
            if small < big:  # one noise size (the default) has no linearity to report
                sig.gain_small = med(self.gains[small])
                sig.linearity = sig.gain_small / sig.gain if sig.gain > 0 else float("nan")
        if self.dc_dead:
            sig.dc_dead, sig.dc_low = med(self.dc_dead), med(self.dc_low)
            sig.flat_zero, sig.flat_value = med(self.flat_zero), med(self.flat_value)
            sig.n_probed = int(np.median(self.probed))
        if self.batch_dep:
            sig.batch_dep, sig.batch_dep_level, sig.batch_dep_moved = max(
                self.batch_dep, key=lambda v: v[0] if np.isfinite(v[0]) else -1.0)
        sig.width = self.width
        if self.scale:
            sig.scale_broken, sig.scale_n, sig.scale_pattern, sig.scale_size = max(self.scale)
        if self.causal:
            sig.causal_broken, sig.causal_n, sig.causal_size = max(self.causal)
        if self.host:
            sig.host_red = max(self.host, key=lambda v: v if not np.isnan(v) else -1.0)
            sig.host_channel_red = st.nanmax(self.host_channel)
        if self.host_zeros:
            sig.host_zeros = min(self.host_zeros)
        if self.instab:
            sig.instability = st.nanmax(self.instab)
            sig.instab_changed = st.nanmax(self.changed)
            sig.instab_kurtosis = self.diffs.kurtosis if self.any_diffs else 0.0
        return sig


def _valid_rows(x, before, rows, probes, valid):
    """The arrays of one round narrowed to the rows ``valid`` keeps, as batch 1; probe rows
    (indices into x's rows) renumbered, probe outputs narrowed with them."""
    width = x.shape[-1]
    x = x.reshape(-1, width)[valid][None]
    if before is not None and before.size // before.shape[-1] == valid.size:
        before = before.reshape(-1, width)[valid][None]
    else:
        before = None
    if rows is not None:
        keep = valid[rows]
        new_index = np.cumsum(valid) - 1
        rows = new_index[rows[keep]]
        probes = [p._replace(data=_narrow(p, keep, valid)) for p in probes]
    return x, before, rows, probes


def _narrow(p: Probe, keep: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """A probe's rows narrowed like the clean record's: probe rows by ``keep``, a record of
    every kept row (``subset`` False) by ``valid``."""
    data = st.rows_of(p.data)
    mask = keep if p.subset else valid
    return data[mask] if mask.size == data.shape[0] else data[:0]


def set_kurtosis_change(signals: list[Signals], gaps: frozenset[int] = frozenset()) -> None:
    """``kurt_change`` of every block from its kurtosis and the previous block's (prefill).
    ``gaps``: the positions after a gap in the dump's blocks (format.layer_numbers.after_gap),
    whose block before is not their input: they get none."""
    blocks = {g.layer: g for g in signals
              if g.site == BLOCK_SITE and g.phase == PREFILL and g.layer >= 0}
    for layer, g in blocks.items():
        before = None if layer in gaps else blocks.get(layer - 1)
        if before is not None and g.kurtosis + 3 > 0 and before.kurtosis + 3 > 0:
            g.kurt_change = float(np.log((g.kurtosis + 3) / (before.kurtosis + 3)))


def _offset_noise(count: int) -> float:
    """The typical |mean| / rms of ``count`` random values: what a round's offset is by
    chance (a single decode token of 576 channels: 0.04)."""
    return 1.0 / math.sqrt(count) if count > 0 else float("nan")
