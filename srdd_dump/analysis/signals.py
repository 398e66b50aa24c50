"""Per-layer signals from a dump: clean statistics and probe responses. Pure numpy.

Every signal is computed per sample (prefill round) and then aggregated over samples with a
median (typical value) or a max (evidence that appears in any sample); see docs/method.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..format import schema as s
from ..format.reader import DumpReader
from .moments import Moments


@dataclass
class Signals:
    layer: int
    site: int  # schema.BLOCK_SITE or an index into the dump's sites
    module: str
    samples: int = 0
    # clean statistics over every captured round
    mean: float = float("nan")
    std: float = float("nan")
    absmax: float = float("nan")
    kurtosis: float = float("nan")
    kurt_change: float = float("nan")  # blocks: log((kurtosis_k + 3) / (kurtosis_{k-1} + 3))
    zero_frac: float = float("nan")
    nan_count: int = 0
    inf_count: int = 0
    # shape of the clean output (prefill rounds)
    pileup: float = float("nan")  # histogram edge bin / its inner neighbours, worse side
    ties: float = float("nan")  # tokens sharing a channel's exact max or min, worst channel
    update_rms: float = float("nan")  # RMS of what the module adds (block: h_k - h_{k-1})
    offset: float = float("nan")  # |mean(update)| / rms(update)
    dc_energy: float = float("nan")  # ||token-mean of update||^2 / mean ||update row||^2
    consistency: float = float("nan")  # 99th pct over channels of |mean_t u_c| / rms_t u_c
    stuck: float = float("nan")  # fraction of channels at one non-zero value over all tokens
    lowbits: float = float("nan")  # fp32 dumps: fraction of values with 16 zero low bits
    # probe responses (NaN when the dump has no probes)
    gain: float = float("nan")  # median std(dO)/rms(dI) at the largest sigma
    gain_spread: float = float("nan")  # robust spread of that gain over samples and draws
    gain_small: float = float("nan")  # the same at the smallest sigma
    linearity: float = float("nan")  # gain_small / gain
    dc_dead: float = float("nan")  # fraction of elements whose dc response is exactly 0
    flat_zero: float = float("nan")  # fraction unmoved by dc and every top-sigma gain draw, =0
    flat_value: float = float("nan")  # ... the same with a non-zero value (clipped)
    dc_low: float = float("nan")  # fraction with |dc response| < 0.15 x its median
    instability: float = float("nan")  # max rms(repeat - clean) / rms(clean)
    instab_changed: float = float("nan")  # fraction of elements a repeat changed (max)
    instab_kurtosis: float = float("nan")  # excess kurtosis of (repeat - clean) differences
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        return d


def _rms(x: np.ndarray) -> float:
    if not x.size:
        return float("nan")
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def _pileup(x: np.ndarray, bins: int = 100) -> float:
    x = x[np.isfinite(x)]
    if x.size < 10 * bins or x.min() == x.max():
        return float("nan")
    hist, _ = np.histogram(x, bins=bins)
    hist = hist.astype(np.float64)
    right = hist[-1] / max(1.0, (hist[-3] + hist[-4]) / 2)
    left = hist[0] / max(1.0, (hist[2] + hist[3]) / 2)
    return float(max(left, right))


def _ties(rows: np.ndarray) -> float:
    """Most tokens sharing one channel's exact maximum (if > 0) or minimum (if < 0). Clipping
    leaves many; a continuous healthy output attains each channel's extremes once. Identical
    rows (a prompt prefix repeated across a batch) are counted once."""
    rows = np.unique(np.where(np.isfinite(rows), rows, 0.0), axis=0)
    if rows.shape[0] < 2:
        return float("nan")
    hi, lo = rows.max(axis=0), rows.min(axis=0)
    at_hi = np.where(hi > 0, (rows == hi).sum(axis=0), 1)
    at_lo = np.where(lo < 0, (rows == lo).sum(axis=0), 1)
    return float(max(at_hi.max(), at_lo.max()))


def _excess_kurtosis(x: np.ndarray) -> float:
    m = Moments().add(x)
    return m.kurtosis


class _Rounds:
    """Round lookups shared by every layer of one file."""

    def __init__(self, reader: DumpReader):
        self.reader = reader
        self.by_round = {int(r["round"]): r for r in reader.rounds}
        self.sample = {k: int(r["sample"]) for k, r in self.by_round.items()}
        self.probe_rows = {
            k: reader.probe_rows(r) for k, r in self.by_round.items() if r["prow_len"] > 0
        }


def _records(reader: DumpReader, layer: int, site: int, rounds: _Rounds) -> np.ndarray:
    recs = reader.select(layer, None, site)
    # records of a round cut off by a crash are not trusted
    return recs[np.isin(recs["round"], list(rounds.by_round))]


def _rows(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, x.shape[-1])


def layer_signals(
    reader: DumpReader, layer: int, site: int, rounds: _Rounds, module: str
) -> Signals:
    sig = Signals(layer=layer, site=site, module=module)
    recs = _records(reader, layer, site, rounds)
    clean = recs[recs["kind"] == s.KIND_CLEAN]
    if not len(clean):
        return sig
    moments = Moments()
    samples: set[int] = set()
    per_sample: dict[str, list[float]] = {
        k: [] for k in ("pileup", "ties", "offset", "upd", "dce", "cons", "stuck", "lowbits")
    }
    gains: dict[float, list[float]] = {}
    dc_dead, dc_low, instab, changed, diffs = [], [], [], [], []
    flat_zero, flat_value = [], []
    prev_clean = None
    if site == s.BLOCK_SITE:
        prev = _records(reader, layer - 1, s.BLOCK_SITE, rounds)
        prev_clean = {int(r["round"]): r for r in prev[prev["kind"] == s.KIND_CLEAN]}
    for rec in clean:
        rnd = int(rec["round"])
        x = reader.read(rec)
        moments.add(x)
        samples.add(rounds.sample[rnd])
        if rounds.by_round[rnd]["step"] != 0:
            continue
        finite = x[np.isfinite(x)]
        per_sample["pileup"].append(_pileup(finite))
        per_sample["ties"].append(_ties(_rows(x)))
        update = x
        if prev_clean is not None and rnd in prev_clean:
            before = reader.read(prev_clean[rnd])
            if before.shape == x.shape:
                update = x - before
        upd = update[np.isfinite(update)]
        rms = _rms(upd)
        per_sample["upd"].append(rms)
        per_sample["offset"].append(abs(float(upd.mean())) / rms if rms > 0 else float("nan"))
        _channel_signals(_rows(update), _rows(x), per_sample)
        if reader.dtype_of(rec) == "float32":
            nz = finite[finite != 0].astype(np.float32)
            if nz.size:
                low = (nz.view(np.uint32) & np.uint32(0xFFFF)) == 0
                per_sample["lowbits"].append(float(np.mean(low)))

        rows = rounds.probe_rows.get(rnd)
        probes = recs[(recs["round"] == rnd) & (recs["kind"] != s.KIND_CLEAN)]
        if rows is None or not len(probes):
            continue
        clean_rows = _rows(x)[rows]
        ref_recs = probes[probes["kind"] == s.KIND_REPLAY]
        ref = _rows(reader.read(ref_recs[0])) if len(ref_recs) else clean_rows
        top_sigma = probes["param"][probes["kind"] == s.KIND_GAIN].max(initial=0.0)
        flat = np.ones(clean_rows.shape, dtype=bool)
        for p in probes[probes["kind"] == s.KIND_GAIN]:
            if p["pert_rms"] > 0:
                d = _rows(reader.read(p)) - ref
                gains.setdefault(float(p["param"]), []).append(float(np.std(d)) / p["pert_rms"])
                if p["param"] == top_sigma:
                    flat &= d == 0
        for p in probes[probes["kind"] == s.KIND_DC]:
            d = np.abs(_rows(reader.read(p)) - ref)
            ok = np.isfinite(d)
            if ok.any():
                flat &= d == 0
                dc_dead.append(float(np.mean((d == 0)[ok])))
                # flat under every perturbation: 0 -> dead zone, non-zero -> clipped
                flat_zero.append(float(np.mean((flat & (ref == 0))[ok])))
                flat_value.append(float(np.mean((flat & (ref != 0))[ok])))
                med = float(np.median(d[ok]))
                dc_low.append(float(np.mean(d[ok] < 0.15 * med)) if med > 0 else 1.0)
        scale = _rms(clean_rows)
        for p in probes[probes["kind"] == s.KIND_REPEAT]:
            d = _rows(reader.read(p)) - clean_rows
            d = np.where(np.isfinite(d), d, 0.0)
            instab.append(_rms(d) / scale if scale > 0 else float("nan"))
            nz = d != 0
            changed.append(float(np.mean(nz)))
            if nz.any():
                diffs.append(d.reshape(-1))
    sig.samples = len(samples)
    sig.mean, sig.std, sig.absmax = moments.mean, moments.std, float(moments.absmax)
    sig.kurtosis, sig.zero_frac = moments.kurtosis, moments.zero_frac
    sig.nan_count, sig.inf_count = int(moments.nan_count), int(moments.inf_count)
    med = _nanmedian
    sig.pileup = _nanmax(per_sample["pileup"])
    sig.ties = _nanmax(per_sample["ties"])
    sig.update_rms = med(per_sample["upd"])
    sig.offset = med(per_sample["offset"])
    sig.dc_energy = med(per_sample["dce"])
    sig.consistency = med(per_sample["cons"])
    sig.stuck = _nanmax(per_sample["stuck"])
    sig.lowbits = med(per_sample["lowbits"])
    if gains:
        big, small = max(gains), min(gains)
        sig.gain = med(gains[big])
        sig.gain_spread = _mad(gains[big])
        sig.gain_small = med(gains[small])
        sig.linearity = sig.gain_small / sig.gain if sig.gain > 0 else float("nan")
    if dc_dead:
        sig.dc_dead, sig.dc_low = med(dc_dead), med(dc_low)
        sig.flat_zero, sig.flat_value = med(flat_zero), med(flat_value)
    if instab:
        sig.instability = _nanmax(instab)
        sig.instab_changed = _nanmax(changed)
        sig.instab_kurtosis = _excess_kurtosis(np.concatenate(diffs)) if diffs else 0.0
    return sig


def _channel_signals(update: np.ndarray, out: np.ndarray, acc: dict[str, list[float]]) -> None:
    """Token-constant structure per channel: bias (constant offset) and stuck channels."""
    if update.shape[0] < 4:
        return
    u = np.where(np.isfinite(update), update, 0.0).astype(np.float64)
    mean_c = u.mean(axis=0)
    rms_c = np.sqrt(np.mean(u * u, axis=0))
    total = float(np.mean(np.sum(u * u, axis=1)))
    acc["dce"].append(float(np.sum(mean_c**2)) / total if total > 0 else float("nan"))
    live = rms_c > 0
    if live.any():
        acc["cons"].append(float(np.percentile(np.abs(mean_c[live]) / rms_c[live], 99)))
    # constant non-zero channels; constant zero channels count as exact zeros (dead zone)
    out = np.unique(out, axis=0)
    if out.shape[0] < 4:
        return
    constant = (np.ptp(out, axis=0) == 0) & (out[0] != 0)
    acc["stuck"].append(float(np.mean(constant)))


def file_signals(reader: DumpReader, progress: bool = False, desc: str = "") -> list[Signals]:
    """Signals of every block and site with clean records, in layer order."""
    from tqdm import tqdm

    rounds = _Rounds(reader)
    out = []
    recs = reader.records
    present = set(zip(recs["layer"][recs["layer"] >= 0].tolist(),
                      recs["site"][recs["layer"] >= 0].tolist()))
    for layer, site in tqdm(sorted(present), desc=desc, unit="layer", disable=not progress,
                            leave=False):
        if site == s.BLOCK_SITE:
            module = reader.layers[layer] if layer < len(reader.layers) else ""
        else:
            module = reader.sites[site] if site < len(reader.sites) else ""
        with np.errstate(all="ignore"):  # faulty layers hold NaN/Inf/1e38: expected, not noise
            out.append(layer_signals(reader, layer, site, rounds, module))
    blocks = {g.layer: g for g in out if g.site == s.BLOCK_SITE}
    for layer, g in blocks.items():
        before = blocks.get(layer - 1)
        if before is not None and g.kurtosis + 3 > 0 and before.kurtosis + 3 > 0:
            g.kurt_change = float(np.log((g.kurtosis + 3) / (before.kurtosis + 3)))
    return out


def _nanmedian(values: list[float]) -> float:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(np.median(v)) if v.size else float("nan")


def _nanmax(values: list[float]) -> float:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(np.max(v)) if v.size else float("nan")


def _mad(values: list[float]) -> float:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(1.4826 * np.median(np.abs(v - np.median(v)))) if v.size else float("nan")
