"""Per-layer signals from a dump: clean statistics and probe responses. Pure numpy.

Every signal is computed per sample (prefill round) and then aggregated over samples with a
median (typical value) or a max (evidence that appears in any sample); see docs/method.md.

The file is read round by round: one HDF5 read per data set covers the records of many layers
(in groups of at most ``SPAN_BYTES``), so memory stays bounded whatever the dump's size, and
``jobs`` > 1 splits the layers among worker processes (the calling process works too).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from ..blas import one_blas_thread
from ..format import schema as s
from ..format.reader import DumpReader
from ..memory import keep_freed_memory
from ..pool import share, spawn_pool
from .moments import BLOCK, Moments
from .sums import dot, total

SPAN_BYTES = 16 << 20  # data read at once: the records of a group of layers of one round


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
    # batched replays: the in-batch reference vs the clean output of the same input
    batch_dep: float = float("nan")  # max |replay - clean| / max |clean|, worst sample
    batch_dep_level: float = float("nan")  # median |clean| / max |clean| where it moved most
    batch_dep_moved: float = float("nan")  # fraction of elements moved by >= half that max
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        return d


# -- per-array statistics ----------------------------------------------------------------------


def _rms(x: np.ndarray) -> float:
    if not x.size:
        return float("nan")
    x = x.reshape(-1).astype(np.float64, copy=False)
    with np.errstate(over="ignore", invalid="ignore"):
        return math.sqrt(dot(x, x) / x.size)


def _std(x: np.ndarray) -> float:
    """``np.std(x)`` in float64: the mean, then the squared deviations from it."""
    if not x.size:
        return float("nan")
    c = x.reshape(-1).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        c -= total(c) / c.size
        return math.sqrt(dot(c, c) / c.size)


def _fraction(mask: np.ndarray) -> float:
    """``np.mean(mask)`` of a boolean array, without converting it to float64."""
    return np.count_nonzero(mask) / mask.size if mask.size else float("nan")


def _pileup(x: np.ndarray, bins: int = 100) -> float:
    """Edge-bin pile-up of ``np.histogram(x, bins)`` (``x``: finite values, 1-D).

    Only bins 0, 2, 3 and -4, -3, -1 are used. Each is counted by comparing ``x`` with numpy's
    own edges (same linspace, same dtype): numpy's histogram puts a value in bin i exactly when
    edges[i] <= x < edges[i + 1] (the last bin closed). Eight compare-and-count passes; binning
    the outer bins' values costs far more when one huge outlier puts nearly every value there."""
    if x.size < 10 * bins:
        return float("nan")
    lo, hi = x.min(), x.max()
    if lo == hi:
        return float("nan")
    dtype = np.result_type(lo, hi, x)
    edges = np.linspace(lo, hi, bins + 1, endpoint=True, dtype=dtype)
    if np.any(edges[:-1] >= edges[1:]):
        np.histogram(x, bins=bins)  # numpy's "too many bins for data range" error
    x = x.astype(dtype, copy=False)
    below = [np.count_nonzero(x < edges[k]) for k in (1, 2, 3, 4)]
    above = [np.count_nonzero(x >= edges[k]) for k in (bins - 4, bins - 3, bins - 2, bins - 1)]
    left_edge, left = below[0], ((below[2] - below[1]) + (below[3] - below[2])) / 2
    right_edge, right = above[3], ((above[0] - above[1]) + (above[1] - above[2])) / 2
    return float(max(right_edge / max(1.0, right), left_edge / max(1.0, left)))


def _median(x: np.ndarray) -> float:
    """``np.median`` of a 1-D array without NaN, through a sort: numpy's vectorised sort beats
    its partition (introselect) by about 4x on AVX-512; the middle values are the same."""
    n = x.size
    if not n:
        return float("nan")
    ordered = np.sort(x)
    half = n // 2
    return float(np.mean(ordered[half - 1: half + 1] if n % 2 == 0 else ordered[half: half + 1]))


def _percentile(x: np.ndarray, q: float) -> float:
    """``np.quantile(x, q)`` (method "linear") of a 1-D float64 array without NaN, by the same
    arithmetic; numpy's own call costs about 100 us of overhead for a few hundred values."""
    n = x.size
    if not n:
        return float("nan")
    v = np.sort(x)
    virtual = (n - 1) * q  # numpy's virtual index for "linear"
    below = min(math.floor(virtual), n - 1)
    above = min(below + 1, n - 1)
    gamma = virtual - below
    a, b = float(v[below]), float(v[above])
    diff = b - a
    return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma  # numpy's _lerp


def _distinct_rows(rows: np.ndarray) -> bool:
    """True when no two rows are equal (as ``np.unique(rows, axis=0)`` compares them): some
    column holds ``len(rows)`` distinct values. False means "maybe": use np.unique."""
    n, width = rows.shape
    if n < 2:
        return True
    for j in sorted({0, width // 4, width // 2, 3 * width // 4, width - 1}):
        if np.unique(rows[:, j]).size == n:
            return True
    return False


def _unique_rows(rows: np.ndarray) -> np.ndarray:
    """The rows with duplicates removed; order does not matter to the callers."""
    return rows if _distinct_rows(rows) else np.unique(rows, axis=0)


def _ties(rows: np.ndarray) -> float:
    """Most tokens sharing one channel's exact maximum (if > 0) or minimum (if < 0). Clipping
    leaves many; a continuous healthy output attains each channel's extremes once. Identical
    rows (a prompt prefix repeated across a batch) are counted once. ``rows`` are finite."""
    rows = _unique_rows(rows)
    if rows.shape[0] < 2:
        return float("nan")
    hi, lo = rows.max(axis=0), rows.min(axis=0)
    at_hi = np.where(hi > 0, np.add.reduce(rows == hi, axis=0, dtype=np.int32), 1)
    at_lo = np.where(lo < 0, np.add.reduce(rows == lo, axis=0, dtype=np.int32), 1)
    return float(max(at_hi.max(), at_lo.max()))


def _batch_dependence(ref: np.ndarray, clean: np.ndarray) -> tuple[float, float, float]:
    """(max |ref - clean| / max |clean|, median |clean| / max |clean| over the elements that
    moved by at least half that max, their fraction) over the finite elements. ``ref`` is the
    module replayed on its recorded input inside a batch of perturbed copies; a batch-invariant
    module gives ``clean`` back up to kernel rounding."""
    nan = float("nan")
    if np.array_equal(ref, clean):  # the usual case, bit-identical (NaN never compares equal)
        top = float(np.abs(clean).max()) if clean.size else 0.0
        if math.isfinite(top):
            return (nan, nan, nan) if top == 0 else (0.0, nan, 0.0)
    d = np.abs(ref - clean)
    if not np.isfinite(d).all():  # rare: drop the non-finite pairs
        ok = np.isfinite(ref) & np.isfinite(clean)
        ref, clean = ref[ok], clean[ok]
        d = np.abs(ref - clean)
    if not d.size:
        return nan, nan, nan
    top = float(np.abs(clean).max())
    if top == 0:
        return nan, nan, nan
    worst = float(d.max())
    if worst == 0:
        return 0.0, nan, 0.0
    moved = d >= 0.5 * worst
    level = _median(np.abs(clean[moved])) / top
    return worst / top, level, np.count_nonzero(moved) / d.size


def _channel_signals(
    u: np.ndarray, out: np.ndarray, acc: dict[str, list[float]]
) -> None:
    """Token-constant structure per channel: bias (constant offset) and stuck channels.
    ``u`` is the update with non-finite values set to 0, as float64 rows."""
    if u.shape[0] < 4:
        return
    mean_c = u.mean(axis=0)
    sq_c = np.einsum("ij,ij->j", u, u)  # per-channel sum of squares, no u * u temporary
    rms_c = np.sqrt(sq_c / u.shape[0])
    per_token = float(sq_c.sum()) / u.shape[0]  # mean over tokens of the sum of squares
    acc["dce"].append(float(np.sum(mean_c**2)) / per_token if per_token > 0 else float("nan"))
    live = rms_c > 0
    if live.any():
        acc["cons"].append(_percentile(np.abs(mean_c[live]) / rms_c[live], 0.99))
    # constant non-zero channels; constant zero channels count as exact zeros (dead zone)
    out = _unique_rows(out)
    if out.shape[0] < 4:
        return
    constant = (np.ptp(out, axis=0) == 0) & (out[0] != 0)
    acc["stuck"].append(float(np.mean(constant)))


class _Kurtosis:
    """Excess kurtosis of a stream of arrays, exactly as ``Moments().add(concatenate(...))``
    (the same blocks of BLOCK elements), without keeping the stream in memory."""

    def __init__(self) -> None:
        self.moments = Moments()
        self.pending: list[np.ndarray] = []
        self.n_pending = 0
        self.any = False

    def add(self, x: np.ndarray) -> None:
        self.any = True
        self.pending.append(x)
        self.n_pending += x.size
        if self.n_pending >= BLOCK:
            flat = np.concatenate(self.pending)
            full = flat.size - flat.size % BLOCK
            self.moments.add(flat[:full])
            rest = flat[full:]
            self.pending, self.n_pending = ([rest] if rest.size else []), rest.size

    @property
    def value(self) -> float:
        if self.pending:
            self.moments.add(np.concatenate(self.pending))
            self.pending, self.n_pending = [], 0
        return self.moments.kurtosis


def _rows(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, x.shape[-1])


# -- one (layer, site) -------------------------------------------------------------------------


class _Layer:
    """Accumulates the signals of one (layer, site) over the rounds, in file order."""

    def __init__(self, layer: int, site: int, module: str):
        self.sig = Signals(layer=layer, site=site, module=module)
        self.moments = Moments()
        self.samples: set[int] = set()
        self.per_sample: dict[str, list[float]] = {
            k: [] for k in ("pileup", "ties", "offset", "upd", "dce", "cons", "stuck", "lowbits")
        }
        self.gains: dict[float, list[float]] = {}
        self.dc_dead: list[float] = []
        self.dc_low: list[float] = []
        self.flat_zero: list[float] = []
        self.flat_value: list[float] = []
        self.instab: list[float] = []
        self.changed: list[float] = []
        self.batch_dep: list[tuple[float, float, float]] = []
        self.diffs = _Kurtosis()

    def add(
        self, x: np.ndarray, dtype: str, sample: int, prefill: bool, before: np.ndarray | None,
        rows: np.ndarray | None, probes: list[tuple[np.void, np.ndarray]],
    ) -> None:
        """One clean record ``x`` (batch, ntok, width); ``before``: the previous block's clean
        output in the same round; ``rows``: the round's probe rows; ``probes``: this module's
        probe records of the round with their data."""
        self.moments.add(x)
        self.samples.add(sample)
        if not prefill:
            return
        acc = self.per_sample
        fin = np.isfinite(x)
        all_finite = bool(fin.all())
        finite = x.reshape(-1) if all_finite else x[fin]
        acc["pileup"].append(_pileup(finite))
        acc["ties"].append(_ties(_rows(x if all_finite else np.where(fin, x, 0.0))))
        update = x
        if before is not None and before.shape == x.shape:
            update = x - before
        fin_u = np.isfinite(update)
        upd_finite = bool(fin_u.all())
        upd = update.reshape(-1) if upd_finite else update[fin_u]
        rms = _rms(upd)
        acc["upd"].append(rms)
        acc["offset"].append(abs(float(upd.mean())) / rms if rms > 0 else float("nan"))
        u = _rows(update if upd_finite else np.where(fin_u, update, 0.0)).astype(np.float64)
        _channel_signals(u, _rows(x), acc)
        if dtype == "float32":
            nonzero = finite != 0
            nnz = np.count_nonzero(nonzero)
            if nnz:
                low = (finite.view(np.uint32) & np.uint32(0xFFFF)) == 0
                acc["lowbits"].append(np.count_nonzero(low & nonzero) / nnz)
        if rows is not None and probes:
            self._probes(_rows(x)[rows], probes)

    def _probes(self, clean_rows: np.ndarray, probes: list[tuple[np.void, np.ndarray]]) -> None:
        refs = [a for p, a in probes if p["kind"] == s.KIND_REPLAY]
        ref = _rows(refs[0]) if refs else clean_rows
        if refs and ref.shape == clean_rows.shape:
            self.batch_dep.append(_batch_dependence(ref, clean_rows))
        top_sigma = max((float(p["param"]) for p, _ in probes if p["kind"] == s.KIND_GAIN),
                        default=0.0)
        top_sigma = max(top_sigma, 0.0)
        flat = np.ones(clean_rows.shape, dtype=bool)
        for p, a in probes:
            if p["kind"] == s.KIND_GAIN and p["pert_rms"] > 0:
                d = _rows(a) - ref
                self.gains.setdefault(float(p["param"]), []).append(_std(d) / p["pert_rms"])
                if p["param"] == top_sigma:
                    flat &= d == 0
        for p, a in probes:
            if p["kind"] != s.KIND_DC:
                continue
            d = np.abs(_rows(a) - ref)
            ok = np.isfinite(d)
            all_ok = bool(ok.all())
            if not (all_ok or ok.any()):
                continue
            dead = d == 0
            flat &= dead
            ref_zero = ref == 0
            if all_ok:
                self.dc_dead.append(_fraction(dead))
                # flat under every perturbation: 0 -> dead zone, non-zero -> clipped
                self.flat_zero.append(_fraction(flat & ref_zero))
                self.flat_value.append(_fraction(flat & ~ref_zero))
                d_ok = d.reshape(-1)
            else:
                self.dc_dead.append(_fraction(dead[ok]))
                self.flat_zero.append(_fraction((flat & ref_zero)[ok]))
                self.flat_value.append(_fraction((flat & ~ref_zero)[ok]))
                d_ok = d[ok]
            med = _median(d_ok)
            self.dc_low.append(_fraction(d_ok < 0.15 * med) if med > 0 else 1.0)
        scale = None
        for p, a in probes:
            if p["kind"] != s.KIND_REPEAT:
                continue
            d = _rows(a) - clean_rows
            fin = np.isfinite(d)
            if not fin.all():
                d = np.where(fin, d, 0.0)
            if scale is None:
                scale = _rms(clean_rows)
            nz = d != 0
            changed = np.count_nonzero(nz)
            # the usual case: the repeat is bit-identical, its rms is 0
            rms = _rms(d) if changed or not d.size else 0.0
            self.instab.append(rms / scale if scale > 0 else float("nan"))
            self.changed.append(changed / nz.size if nz.size else float("nan"))
            if changed:
                self.diffs.add(d.reshape(-1))

    def result(self) -> Signals:
        sig = self.sig
        if not self.samples:
            return sig
        moments, acc, med = self.moments, self.per_sample, _nanmedian
        sig.samples = len(self.samples)
        sig.mean, sig.std, sig.absmax = moments.mean, moments.std, float(moments.absmax)
        sig.kurtosis, sig.zero_frac = moments.kurtosis, moments.zero_frac
        sig.nan_count, sig.inf_count = int(moments.nan_count), int(moments.inf_count)
        sig.pileup = _nanmax(acc["pileup"])
        sig.ties = _nanmax(acc["ties"])
        sig.update_rms = med(acc["upd"])
        sig.offset = med(acc["offset"])
        sig.dc_energy = med(acc["dce"])
        sig.consistency = med(acc["cons"])
        sig.stuck = _nanmax(acc["stuck"])
        sig.lowbits = med(acc["lowbits"])
        if self.gains:
            big, small = max(self.gains), min(self.gains)
            sig.gain = med(self.gains[big])
            sig.gain_spread = _mad(self.gains[big])
            sig.gain_small = med(self.gains[small])
            sig.linearity = sig.gain_small / sig.gain if sig.gain > 0 else float("nan")
        if self.dc_dead:
            sig.dc_dead, sig.dc_low = med(self.dc_dead), med(self.dc_low)
            sig.flat_zero, sig.flat_value = med(self.flat_zero), med(self.flat_value)
        if self.batch_dep:
            sig.batch_dep, sig.batch_dep_level, sig.batch_dep_moved = max(
                self.batch_dep, key=lambda v: v[0] if np.isfinite(v[0]) else -1.0)
        if self.instab:
            sig.instability = _nanmax(self.instab)
            sig.instab_changed = _nanmax(self.changed)
            sig.instab_kurtosis = self.diffs.value if self.diffs.any else 0.0
        return sig


# -- a file ------------------------------------------------------------------------------------


def _key_code(layer, site):
    return np.asarray(layer, dtype=np.int64) * 65536 + (np.asarray(site, dtype=np.int64) + 1)


def _present(reader: DumpReader) -> list[tuple[int, int]]:
    recs = reader.records
    ok = recs["layer"] >= 0
    return sorted(set(zip(recs["layer"][ok].tolist(), recs["site"][ok].tolist())))


def _module(reader: DumpReader, layer: int, site: int) -> str:
    if site == s.BLOCK_SITE:
        return reader.layers[layer] if layer < len(reader.layers) else ""
    return reader.sites[site] if site < len(reader.sites) else ""


def _read_group(reader: DumpReader, records: np.ndarray, index: list[int]) -> dict[int, np.ndarray]:
    """Decoded data of ``records[index]``: one read per data set when they lie close together."""
    out: dict[int, np.ndarray] = {}
    sub = records[index]
    idx = np.asarray(index)
    for data_id in np.unique(sub["data"]).tolist():
        mine = sub["data"] == data_id
        r0 = sub["row0"][mine]
        n = sub["nrows"][mine]
        lo, hi = int(r0.min()), int((r0 + n).max())
        if hi - lo <= 2 * int(n.sum()) + 64:
            rows = reader.read_rows(data_id, lo, hi)
            for i, a, b in zip(idx[mine].tolist(), (r0 - lo).tolist(), (r0 - lo + n).tolist()):
                r = records[i]
                out[i] = rows[a:b].reshape(int(r["batch"]), int(r["ntok"]), int(r["width"]))
        else:
            for i in idx[mine].tolist():
                out[i] = reader.read(records[i])
    return out


def _signals(
    reader: DumpReader, keys: list[tuple[int, int]], progress: bool = False, desc: str = ""
) -> list[Signals]:
    """Signals of the (layer, site) ``keys`` of one file, reading it round by round."""
    recs = reader.records
    by_round = {int(r["round"]): r for r in reader.rounds}
    layers = {k: _Layer(k[0], k[1], _module(reader, *k)) for k in keys}
    if not len(recs) or not keys:
        return [layers[k].result() for k in keys]
    code = _key_code(recs["layer"], recs["site"])
    want = np.isin(code, _key_code([k[0] for k in keys], [k[1] for k in keys]))
    block_layers = np.array([k[0] for k in keys if k[1] == s.BLOCK_SITE], dtype=np.int64)
    prev = ((recs["site"] == s.BLOCK_SITE) & (recs["kind"] == s.KIND_CLEAN)
            & np.isin(recs["layer"].astype(np.int64) + 1, block_layers))
    # records of a round cut off by a crash (no row in /rounds) are not trusted
    need = np.flatnonzero((want | prev) & np.isin(recs["round"], list(by_round)))
    if not need.size:
        return [layers[k].result() for k in keys]
    all_rows = reader.all_probe_rows()
    rounds_of = recs["round"][need]
    order = np.argsort(rounds_of, kind="stable")
    first = {}
    for i in need.tolist():
        first.setdefault(int(recs["round"][i]), i)
    groups: dict[int, list[int]] = {}
    for i in need[order].tolist():
        groups.setdefault(int(recs["round"][i]), []).append(i)
    width_bytes = recs["nrows"].astype(np.int64) * recs["width"] * 4

    from tqdm import tqdm

    for rnd in tqdm(sorted(groups, key=first.__getitem__), desc=desc, unit="round",
                    disable=not progress, leave=False):
        row = by_round[rnd]
        sample, prefill = int(row["sample"]), int(row["step"]) == 0
        prow = None
        if row["prow_len"] > 0:
            off = int(row["prow_off"])
            prow = all_rows[off: off + int(row["prow_len"])]
        index = groups[rnd]
        per_key: dict[tuple[int, int], list[int]] = {}
        clean_prev: dict[int, int] = {}  # layer -> last clean block record of the round
        for i in index:
            r = recs[i]
            key = (int(r["layer"]), int(r["site"]))
            if r["site"] == s.BLOCK_SITE and r["kind"] == s.KIND_CLEAN:
                clean_prev[key[0]] = i
            if key in layers:
                per_key.setdefault(key, []).append(i)
        batch: list[tuple[int, int]] = []
        size = 0
        for key in sorted(per_key):
            batch.append(key)
            size += int(width_bytes[per_key[key]].sum())
            if size >= SPAN_BYTES:
                _round_batch(reader, recs, batch, per_key, clean_prev, layers, sample,
                             prefill, prow)
                batch, size = [], 0
        if batch:
            _round_batch(reader, recs, batch, per_key, clean_prev, layers, sample, prefill,
                         prow)
    return [layers[k].result() for k in keys]


def _round_batch(reader, recs, batch, per_key, clean_prev, layers, sample, prefill, prow):
    index: list[int] = []
    for key in batch:
        index += per_key[key]
        if key[1] == s.BLOCK_SITE and key[0] - 1 in clean_prev:
            index.append(clean_prev[key[0] - 1])
    data = _read_group(reader, recs, sorted(set(index)))
    with np.errstate(all="ignore"):  # faulty layers hold NaN/Inf/1e38: expected, not noise
        for key in batch:
            mine = per_key[key]
            clean = [i for i in mine if recs["kind"][i] == s.KIND_CLEAN]
            probes = [(recs[i], data[i]) for i in mine if recs["kind"][i] != s.KIND_CLEAN]
            before = None
            if key[1] == s.BLOCK_SITE and key[0] - 1 in clean_prev:
                before = data[clean_prev[key[0] - 1]]
            for i in clean:
                layers[key].add(data[i], reader.dtype_of(recs[i]), sample, prefill, before,
                                prow, probes)


# -- process pool ------------------------------------------------------------------------------


def _worker(path: str, keys: list[tuple[int, int]]) -> list[Signals]:
    """A worker process's share: the signals of ``keys`` of the file at ``path``."""
    keep_freed_memory()
    with DumpReader(path) as reader:
        return _signals(reader, keys)


def _chunks(reader: DumpReader, keys: list[tuple[int, int]], jobs: int) -> list[list]:
    """``keys`` in runs of consecutive layers, each about 1 / (2 * jobs) of the bytes left: large
    runs first, single layers at the end, so no process waits long for the last one. (Every
    run reads its first block's previous layer once more.)"""
    recs = reader.records
    code = _key_code(recs["layer"], recs["site"])
    nbytes = recs["nrows"].astype(np.int64) * recs["width"]
    per = {int(c): int(b) for c, b in zip(*_group_sum(code, nbytes))}
    weights = [per.get(int(_key_code(*k)), 0) + 1 for k in keys]
    left = sum(weights)
    out, cur, acc = [], [], 0
    for key, w in zip(keys, weights):
        cur.append(key)
        acc += w
        if acc >= left / (2 * jobs):
            out.append(cur)
            left -= acc
            cur, acc = [], 0
    if cur:
        out.append(cur)
    return out


def _group_sum(codes: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    uniq, inv = np.unique(codes, return_inverse=True)
    return uniq, np.bincount(inv, weights=values)


def file_signals(
    reader: DumpReader, progress: bool = False, desc: str = "", jobs: int = 1,
    pool=None,
) -> list[Signals]:
    """Signals of every block and site with clean records, in layer order.

    ``jobs`` > 1 splits the layers among worker processes (``pool``: a ProcessPoolExecutor to
    reuse, else one is made for this call); this process computes a share too."""
    keep_freed_memory()
    with one_blas_thread():
        out = _file_signals(reader, progress, desc, jobs, pool)
    blocks = {g.layer: g for g in out if g.site == s.BLOCK_SITE}
    for layer, g in blocks.items():
        before = blocks.get(layer - 1)
        if before is not None and g.kurtosis + 3 > 0 and before.kurtosis + 3 > 0:
            g.kurt_change = float(np.log((g.kurtosis + 3) / (before.kurtosis + 3)))
    return out


def _file_signals(reader: DumpReader, progress: bool, desc: str, jobs: int, pool) -> list:
    keys = _present(reader)
    if jobs <= 1 or len(keys) < 2:
        return _signals(reader, keys, progress, desc)
    chunks = _chunks(reader, keys, jobs)
    own_pool = pool is None
    if own_pool:
        pool = spawn_pool(jobs - 1)
    try:
        # each chunk to whoever is free first: a worker process or this one
        results = share(chunks, lambda keys: _signals(reader, keys),
                        functools.partial(_worker, reader.path), pool, jobs - 1)
    finally:
        if own_pool:
            pool.shutdown()
    by_key = {(g.layer, g.site): g for part in results for g in part}
    return [by_key[k] for k in keys]


# -- aggregation -------------------------------------------------------------------------------


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

