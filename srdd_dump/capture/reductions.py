"""The per-round reductions of ``--store stats``, computed on the tensor's own device.

Each function mirrors one of ``analysis.signals.round_stats`` / ``analysis.array_stats`` /
``analysis.identities`` with torch ops, so that a stats dump gives the compare the numbers it
would have computed from the tensors (tests/test_stats_store.py holds the two side by side).
Little leaves the device: the histogram's two range values (its edges are computed by
numpy, as the compare does), the tie candidates' extremes, a row's distinct values when an
8-bit grid can hold them (at most 257), and the reductions themselves. The
host replay's rows are compared on the host, where that replay ran.

Sums run in float64 where the device has it (CPU, CUDA) and in float32 elsewhere (NPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..format import schema as s
from ..vocabulary import (
    CHANNEL_FLOOR,
    CLIP_MIN_ROWS,
    DC_LOW,
    GRID_LEVELS,
    LOW_BITS_MASK,
    LOWBITS_BY_VALUE,
    PILEUP_BINS,
    TIE_CANDIDATES,
    TIE_DENSITY_VALUES,
    TIE_MIN_LEVELS,
    UNIT_ROUNDOFF,
    grid_min_values,
    grid_row_picks,
    on_grid,
    span_levels,
    stuck_min_tokens,
    ties_by_chance,
)

NAN = float("nan")
_RANGE = {
    "float64": (np.finfo(np.float64).tiny, np.finfo(np.float64).max),
    "float32": (np.finfo(np.float32).tiny, np.finfo(np.float32).max),
    "bfloat16": (np.finfo(np.float32).tiny, 3.38e38),
    "float16": (np.finfo(np.float16).tiny, np.finfo(np.float16).max),
}


@dataclass
class ProbeRows:
    """One probe replay's output rows, as ``analysis.signals.Probe`` holds them."""

    kind: str
    param: float
    probe: int
    pert_rms: float
    data: torch.Tensor  # (rows, width)
    subset: bool = True


def accumulator(device: torch.device) -> torch.dtype:
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def reduce_round(
    x: torch.Tensor, dtype: str, before: torch.Tensor | None = None,
    rows: torch.Tensor | None = None, probes: list[ProbeRows] = (),
    valid: torch.Tensor | None = None, positions: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
) -> dict[str, float] | None:
    """The stats columns of one clean output ``x`` (batch, ntok, width) and its probes (the
    arguments of ``analysis.signals.round_stats``, as device tensors); None when the attention
    mask leaves no row. ``ids``: each row's token id (on the CPU), where known."""
    width = x.shape[-1]
    x = _as_float(x).reshape(-1, width)
    if ids is not None:
        ids = ids.reshape(-1) if ids.numel() == x.shape[0] else None
    if before is not None:
        before = _as_float(before).reshape(-1, width)
    if valid is not None and valid.numel() == x.shape[0] and not bool(valid.all()):
        valid = valid.to(x.device)
        if positions is not None and positions.numel() == valid.numel():
            positions = positions.to(x.device)[valid]
        if ids is not None:
            ids = ids[valid.to(ids.device)]
        x, before, rows, probes = _valid_rows(x, before, rows, probes, valid)
        if not x.numel():
            return None
    out: dict[str, float] = {}
    acc = accumulator(x.device)
    all_finite = _all_finite(x)
    fin = None if all_finite else torch.isfinite(x)
    finite = x.reshape(-1) if all_finite else x[fin]
    out.update(_moments(x, acc, prefix="", all_finite=all_finite))
    out["rows"] = float(x.shape[0])
    out["pileup"] = pileup(finite)
    keep = unique_index(x)
    distinct = x if keep is None else x[keep]  # shared by the tie count and the stuck channels
    out["distinct"] = float(distinct.numel())  # what the offset's chance level is of
    if all_finite:
        out["ties"], out["tie_excess"] = ties(
            distinct, distinct=True, ids=ids if ids is None or keep is None else ids[keep.cpu()])
    else:
        out["ties"], out["tie_excess"] = ties(torch.where(fin, x, 0.0), ids=ids)
    update = x
    if before is not None and before.shape == x.shape:
        update = x - before
    upd_finite = _all_finite(update)
    fin_u = None if upd_finite else torch.isfinite(update)
    u = (update if upd_finite else torch.where(fin_u, update, 0.0)).to(acc)
    upd = u.reshape(-1) if upd_finite else update[fin_u].to(acc)
    upd_rms = math.sqrt(float(torch.dot(upd, upd)) / upd.numel()) if upd.numel() else NAN
    out["update_rms"] = upd_rms
    out["offset"] = (abs(float(upd.sum())) / upd.numel() / upd_rms if upd_rms > 0 else NAN)
    out["dc_energy"], out["consistency"], out["stuck"] = channel_signals(u, distinct, True)
    mask = LOW_BITS_MASK.get(dtype)
    if mask is not None and finite.dtype == torch.float32:  # numpy: the same on float32
        nonzero = finite != 0
        nnz = int(nonzero.sum())
        if nnz:
            low = (finite.view(torch.int32) & mask) == 0
            out["lowbits"] = int((low & nonzero).sum()) / nnz
            if out["lowbits"] > LOWBITS_BY_VALUE:  # signals.round_stats: by distinct value
                values = torch.unique(finite[nonzero])
                out["lowbits"] = int(((values.view(torch.int32) & mask) == 0).sum()) \
                    / values.numel()
    out["grid"] = grid_rows(x, dtype)
    if rows is not None and probes:
        rows = rows.to(x.device)
        if rows.numel() and int(rows.max()) >= x.shape[0]:
            rows = rows[:0]  # a model-level operator (rotary) has fewer rows than the round
        row_pos = None
        if positions is not None and rows.numel() and positions.numel() > int(rows.max()):
            row_pos = positions.to(x.device)[rows]
        _identities(out, x, rows, row_pos, probes, dtype)
        _probes(out, x[rows], probes, acc)
    return out


def grid_rows(rows: torch.Tensor, dtype: str) -> float:
    """``analysis.array_stats.grid_rows``: the share of tested rows on an 8-bit grid. A row's
    distinct values leave the device only when they are few enough to be one (GRID_LEVELS)."""
    if rows.dim() != 2 or not rows.shape[0]:
        return NAN
    eps = UNIT_ROUNDOFF.get(dtype, 2.0 ** -24)
    wide = torch.float64 if rows.device.type in ("cpu", "cuda") else torch.float32
    tested = on = 0
    for r in grid_row_picks(rows.shape[0]):
        v = rows[int(r)]
        v = v[torch.isfinite(v)]
        if int(torch.count_nonzero(v)) < grid_min_values(dtype):
            continue
        tested += 1
        u = torch.unique(v.to(wide))
        on += u.numel() <= GRID_LEVELS + 1 and on_grid(u.cpu().double().numpy(), eps)
    return on / tested if tested else NAN


def _as_float(t: torch.Tensor) -> torch.Tensor:
    """float32, as the reader gives stored values back (float64 stays float64)."""
    t = t.detach()
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _valid_rows(x, before, rows, probes, valid):
    x = x[valid]
    before = before[valid] if before is not None and before.shape[0] == valid.numel() else None
    if rows is not None:
        rows = rows.to(valid.device)
        keep = valid[rows]
        new_index = torch.cumsum(valid.long(), 0) - 1
        rows = new_index[rows[keep]]
        narrowed = []
        for p in probes:
            mask = keep if p.subset else valid
            data = p.data.reshape(-1, p.data.shape[-1])
            data = data[mask] if mask.numel() == data.shape[0] else data[:0]
            narrowed.append(ProbeRows(p.kind, p.param, p.probe, p.pert_rms, data, p.subset))
        probes = narrowed
    return x, before, rows, probes


def _moments(x: torch.Tensor, acc: torch.dtype, prefix: str, all_finite: bool = False
             ) -> dict[str, float]:
    """analysis.moments.Moments of ``x``: counts, mean, central sums M2..M4 of the finite
    values (two passes over the whole tensor)."""
    flat = x.reshape(-1)
    names = [prefix + c for c in s.MOMENT_COLUMNS] if prefix == "" else \
        [prefix + c for c in ("n", "mean", "m2", "m3", "m4")]
    n_nan = n_inf = 0
    if not all_finite:
        finite = torch.isfinite(flat)
        n_nan = int(torch.isnan(flat).sum())
        n_inf = flat.numel() - int(finite.sum()) - n_nan
        if n_nan or n_inf:
            flat = flat[finite]
    n = flat.numel()
    values = dict.fromkeys(names, 0.0)
    if n:
        lo, hi = (float(v) for v in torch.aminmax(flat))
        if lo == hi:
            mean, m2, m3, m4 = lo, 0.0, 0.0, 0.0
        else:  # two passes: the mean, then the central sums (in place, dot products)
            d = flat.to(acc, copy=True)
            mean_t = d.sum() / n
            d.sub_(mean_t)
            d2 = d * d
            sums = torch.stack([mean_t, d2.sum(), torch.dot(d2, d), torch.dot(d2, d2)])
            mean, m2, m3, m4 = sums.tolist()
        values.update(zip(names[:5], (n, mean, m2, m3, m4)))
        if prefix == "":
            values.update(absmax=max(abs(lo), abs(hi)), zeros=int((flat == 0).sum()))
    if prefix == "":
        values.update(nan=n_nan, inf=n_inf)
    return values


def _rms(x: torch.Tensor, acc: torch.dtype) -> float:
    if not x.numel():
        return NAN
    x = x.reshape(-1).to(acc)
    return math.sqrt(float(torch.dot(x, x)) / x.numel())


def _std(x: torch.Tensor, acc: torch.dtype) -> float:
    if not x.numel():
        return NAN
    c = x.reshape(-1).to(acc)
    c = c - c.sum() / c.numel()
    return math.sqrt(float(torch.dot(c, c)) / c.numel())


def _median(x: torch.Tensor) -> float:
    """numpy's median (the mean of the two middle values, in their dtype) of a tensor without
    NaN. A tensor on the CPU is sorted by numpy in place (no copy): torch's CPU sort of 30,000
    values costs 1.7 ms, numpy's 0.05 ms; elsewhere by two selections on the device."""
    n = x.numel()
    if not n:
        return NAN
    flat = x.detach().reshape(-1)
    half = n // 2
    if flat.device.type == "cpu":
        ordered = np.sort(flat.numpy())
        if n % 2:
            return float(ordered[half])
        return float(ordered[half - 1: half + 1].sum(dtype=ordered.dtype) / ordered.dtype.type(2))
    upper = float(torch.kthvalue(flat, half + 1).values)
    if n % 2:
        return upper
    return (float(torch.kthvalue(flat, half).values) + upper) / 2


def _percentile(x: torch.Tensor, q: float) -> float:
    """numpy's quantile (method "linear") of a 1-D tensor without NaN, by its arithmetic."""
    n = x.numel()
    if not n:
        return NAN
    v = np.sort(x.detach().cpu().numpy()) if x.device.type == "cpu" else None
    if v is None:
        v = torch.sort(x.detach().reshape(-1)).values.cpu().numpy()  # a vector per channel
    virtual = (n - 1) * q
    below = min(math.floor(virtual), n - 1)
    above = min(below + 1, n - 1)
    gamma = virtual - below
    a, b = float(v[below]), float(v[above])
    diff = b - a
    return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma


def _all_finite(x: torch.Tensor) -> bool:
    """A finite sum proves every value finite (one reduction instead of a mask); an overflowing
    sum of finite values falls back to the mask."""
    return math.isfinite(float(x.sum())) or bool(torch.isfinite(x).all())


def pileup(x: torch.Tensor, bins: int = PILEUP_BINS) -> float:
    """array_stats.pileup: the edges from numpy (the same linspace), the counts on the device."""
    if x.numel() < 10 * bins:
        return NAN
    lo_t, hi_t = torch.aminmax(x)
    np_dtype = np.float64 if x.dtype == torch.float64 else np.float32
    lo, hi = np_dtype(lo_t.item()), np_dtype(hi_t.item())
    if lo == hi:
        return NAN
    edges = np.linspace(lo, hi, bins + 1, endpoint=True, dtype=np_dtype)
    if np.any(edges[:-1] >= edges[1:]):
        return NAN
    cuts = edges[[1, 2, 3, 4, bins - 4, bins - 3, bins - 2, bins - 1]]
    if x.device.type == "cpu":  # numpy's compare-and-count on the tensor's memory: 5x faster
        v = x.detach().numpy()
        counts = [np.count_nonzero(v < c) for c in cuts[:4]] + [
            np.count_nonzero(v >= c) for c in cuts[4:]]
    else:
        t = torch.from_numpy(cuts).to(x.device)
        counts = [int((x < c).sum()) for c in t[:4]] + [int((x >= c).sum()) for c in t[4:]]
    below, above = counts[:4], counts[4:]
    left_edge, left = below[0], ((below[2] - below[1]) + (below[3] - below[2])) / 2
    right_edge, right = above[3], ((above[0] - above[1]) + (above[1] - above[2])) / 2
    return float(max(right_edge / max(1.0, right), left_edge / max(1.0, left)))


def unique_index(rows: torch.Tensor) -> torch.Tensor | None:
    """array_stats.unique_index: the first of each set of equal rows, ascending (on the rows'
    device); None when no two rows are equal."""
    n, width = rows.shape
    if n < 2:
        return None
    columns = sorted({0, width // 4, width // 2, 3 * width // 4, width - 1})
    if rows.device.type == "cpu":  # numpy on the tensor's memory: 10x less overhead
        view = rows.detach().numpy()
        if any(np.unique(view[:, j]).size == n for j in columns):
            return None
    elif any(torch.unique(rows[:, j]).numel() == n for j in columns):
        return None
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), n, dtype=torch.int64, device=rows.device)
    first.scatter_reduce_(0, inverse, torch.arange(n, device=rows.device), "amin")
    return torch.sort(first).values


def unique_rows(rows: torch.Tensor) -> torch.Tensor:
    """array_stats.unique_rows: the rows with duplicates removed (order does not matter)."""
    keep = unique_index(rows)
    return rows if keep is None else rows[keep]


def _distinct_tokens(ids: torch.Tensor) -> int:
    return int(torch.unique(ids).numel())


def _tokens_at(rows: torch.Tensor, extreme: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """array_stats._tokens_at: per column, the different tokens whose row equals ``extreme``."""
    groups = torch.unique(ids, return_inverse=True)[1].to(rows.device)
    hits = torch.zeros((int(groups.max()) + 1, rows.shape[1]), dtype=torch.int32,
                       device=rows.device)
    hits.index_add_(0, groups, (rows == extreme).to(torch.int32))
    return (hits > 0).sum(dim=0)


def _levels(col: torch.Tensor, top: float, bottom: float) -> float:
    """array_stats._levels: (top - bottom) in steps of the values' own precision."""
    bits = col.to(torch.float32).contiguous().view(torch.int32) & 0x7FFFFF
    lowest = bits & (-bits)
    lowest = lowest[lowest > 0]
    zeros = int(lowest.min()).bit_length() - 1 if lowest.numel() else 23
    step = float(np.spacing(np.float32(abs(top)))) * 2.0 ** zeros
    return abs(top - bottom) / step if step > 0 else float("inf")


def _by_chance(n: int, col: torch.Tensor, top: float, inner: torch.Tensor, width: int) -> bool:
    """array_stats._by_chance."""
    if not inner.numel():
        return False
    nearest = torch.topk(inner, min(TIE_DENSITY_VALUES, inner.numel())).values
    return ties_by_chance(n, nearest.numel(), _levels(col, top, float(nearest.min())), width)


def _near_copies(rows: torch.Tensor, tied: torch.Tensor, spread: dict) -> bool:
    """``spread``: the round's median channel spread, computed at the first need and kept for
    the other candidate channels (it does not depend on them); the spreads in float32 (a
    bfloat16 std on a CPU is several times a forward's cost, and numpy reads the same values
    as float32)."""
    if int(tied.sum()) < 2:
        return False
    group = rows[tied]
    width = rows.shape[1]
    equal = int((group.amax(dim=0) == group.amin(dim=0)).sum())
    if equal >= max(8, 0.05 * width):
        return True
    if "all" not in spread:
        spread["all"] = _median(rows.float().std(dim=0, unbiased=False))
    spread_all = spread["all"]
    return spread_all > 0 and _median(group.float().std(dim=0, unbiased=False)) < 0.1 * spread_all


def ties(rows: torch.Tensor, candidates: int = TIE_CANDIDATES, distinct: bool = False,
         ids: torch.Tensor | None = None) -> tuple[float, float]:
    """array_stats.ties of finite (rows, width); ``ids`` on the CPU."""
    if not distinct:
        keep = unique_index(rows)
        if keep is not None:
            rows, ids = rows[keep], None if ids is None else ids[keep.cpu()]
    if ids is not None and ids.shape[0] != rows.shape[0]:
        ids = None
    if rows.shape[0] < 2:
        return NAN, NAN
    hi, lo = rows.amax(dim=0), rows.amin(dim=0)
    one = torch.ones_like(hi, dtype=torch.int64)
    at_hi = torch.where(hi > 0, (rows == hi).sum(dim=0), one)
    at_lo = torch.where(lo < 0, (rows == lo).sum(dim=0), one)
    count = int(torch.maximum(at_hi.max(), at_lo.max()))
    if count < 2:
        return float(count), 1.0
    rank_hi, rank_lo = at_hi, at_lo  # array_stats.ties: by token where the ids are known
    if ids is not None and _distinct_tokens(ids) < ids.numel():
        rank_hi = torch.where(hi > 0, _tokens_at(rows, hi, ids), one)
        rank_lo = torch.where(lo < 0, _tokens_at(rows, lo, ids), one)
    best = (1.0, 1)
    spread: dict = {}
    for at, rank, ext, sign in ((at_hi, rank_hi, hi, 1.0), (at_lo, rank_lo, lo, -1.0)):
        order = torch.sort(-rank, stable=True).indices[:candidates].tolist()
        counts_at = at[order].tolist()
        ranks = rank[order].tolist()
        extremes = ext[order].tolist()
        for c, n, r, e in zip(order, counts_at, ranks, extremes):
            if r < 2:
                break
            col = rows[:, c] * sign
            top = e * sign
            inner = col[col < top]
            values, counts = torch.unique(inner, return_counts=True)
            if values.numel() and _levels(col, top, float(values[0])) < TIE_MIN_LEVELS:
                continue
            tied = col == top
            if _near_copies(rows, tied, spread):
                continue
            if ids is not None:
                n = _distinct_tokens(ids[tied.cpu()])
                if n < 2:
                    continue
                counts = torch.tensor([_distinct_tokens(ids[(col == v).cpu()])
                                       for v in values[-2:].tolist()])
            if _by_chance(n, col, top, inner, rows.shape[1]):
                continue
            neighbours = float(counts[-2:].double().mean()) if counts.numel() else 1.0
            best = max(best, (n / max(1.0, neighbours), n))
    return float(count), float(best[0])


def channel_signals(u: torch.Tensor, out: torch.Tensor, distinct: bool = False
                    ) -> tuple[float, float, float]:
    """array_stats.channel_signals: (dc energy, consistency, stuck)."""
    if u.shape[0] < 4:
        return NAN, NAN, NAN
    mean_c = u.mean(dim=0)
    sq_c = (u * u).sum(dim=0)  # torch.einsum is 10x slower on the CPU
    rms_c = torch.sqrt(sq_c / u.shape[0])
    per_token = float(sq_c.sum()) / u.shape[0]
    dce = float((mean_c * mean_c).sum()) / per_token if per_token > 0 else NAN
    live = rms_c > 0
    cons = NAN
    if bool(live.any()):
        cons = _percentile((mean_c[live].abs() / rms_c[live]).to(torch.float64), 0.99)
    out = out if distinct else unique_rows(out)
    if out.shape[0] < stuck_min_tokens(out.shape[1]):
        return dce, cons, NAN
    constant = ((out.amax(dim=0) - out.amin(dim=0)) == 0) & (out[0] != 0)
    return dce, cons, float(constant.double().mean())


def batch_dependence(ref: torch.Tensor, clean: torch.Tensor) -> tuple[float, float, float]:
    """array_stats.batch_dependence."""
    if torch.equal(ref, clean):
        top = float(clean.abs().max()) if clean.numel() else 0.0
        if math.isfinite(top):
            return (NAN, NAN, NAN) if top == 0 else (0.0, NAN, 0.0)
    d = (ref - clean).abs()
    if not _all_finite(d):
        ok = torch.isfinite(ref) & torch.isfinite(clean)
        ref, clean = ref[ok], clean[ok]
        d = (ref - clean).abs()
    if not d.numel():
        return NAN, NAN, NAN
    top = float(clean.abs().max())
    if top == 0:
        return NAN, NAN, NAN
    worst = float(d.max())
    if worst == 0:
        return 0.0, NAN, 0.0
    moved = d >= 0.5 * worst
    level = _median(clean[moved].abs()) / top
    return worst / top, level, int(moved.sum()) / d.numel()


def relative_distance(device: torch.Tensor, host: torch.Tensor) -> float:
    """identities.relative_distance (the baseline's RED): ||device - host|| / ||host||."""
    if device.numel() != host.numel() or not device.numel():
        return NAN
    g = host.reshape(-1).to(torch.float64)
    m = device.reshape(-1).to(torch.float64)
    fg, fm = torch.isfinite(g), torch.isfinite(m)
    both = fg & fm
    if not bool(both.all()):
        bad = ~both
        gb, mb = g[bad], m[bad]
        same = (torch.isnan(gb) & torch.isnan(mb)) | (torch.isinf(gb) & (gb == mb))
        if int(bad.sum()) - int(same.sum()):
            return float("inf")
        g, m = g[both], m[both]
    gg = float(torch.dot(g, g))
    d = m - g
    dd = float(torch.dot(d, d))
    if gg == 0:
        return 0.0 if dd == 0 else float("inf")
    return math.sqrt(dd / gg)


def channel_distance(device: torch.Tensor, host: torch.Tensor) -> float:
    """identities.channel_distance: the worst channel's relative distance."""
    d = device.reshape(-1, device.shape[-1]).to(torch.float64)
    h = host.reshape(-1, host.shape[-1]).to(torch.float64)
    if d.shape != h.shape or d.shape[0] < 8:
        return NAN
    ok = torch.isfinite(h).all(dim=0) & torch.isfinite(d).all(dim=0)
    if not bool(ok.any()):
        return NAN
    d, h = d[:, ok], h[:, ok]
    norm = torch.sqrt((h * h).mean(dim=0))
    live = norm >= CHANNEL_FLOOR * _median(norm)
    if not bool(live.any()):
        return NAN
    err = torch.sqrt(((d - h) ** 2).mean(dim=0))
    return float((err[live] / norm[live]).max())


def scale_check(ref: torch.Tensor, scaled: torch.Tensor, k: int, dtype: str
                ) -> tuple[int, int, str, float]:
    """identities.scale_check: (broken, judged, pattern, size)."""
    if ref.shape != scaled.shape or not ref.numel():
        return 0, 0, "", 0.0
    tiny, big = _RANGE.get(dtype, _RANGE["float32"])
    margin = 2.0 ** (abs(k) + 1)
    size = torch.maximum(ref.abs(), scaled.abs())
    judged = (torch.isfinite(ref) & torch.isfinite(scaled) & (size >= tiny * margin)
              & (size <= big / margin))
    broken = judged & (ref != scaled)
    n_broken, n_judged = int(broken.sum()), int(judged.sum())
    if not n_broken:
        return 0, n_judged, "", 0.0
    return (n_broken, n_judged, scale_pattern(ref, scaled, broken),
            relative_distance(scaled[judged], ref[judged]))


def zero_check(out: torch.Tensor, clean: torch.Tensor) -> tuple[int, int, str, float]:
    """identities.zero_check: (broken, judged, pattern, size)."""
    out = out.reshape(-1, out.shape[-1]).double()
    broken = out != 0
    n_broken = int(broken.sum())
    if not n_broken:
        return 0, out.numel(), "", 0.0
    scale = float(clean.double().pow(2).mean().sqrt()) if clean.numel() else 0.0
    size = float(torch.where(torch.isfinite(out), out, 0.0).pow(2).mean().sqrt())
    columns = broken.any(dim=0).nonzero().flatten()
    part = out[:, columns]
    constant = (part == part[:1]).all(dim=0)
    pattern = ("" if out.shape[0] < 2 else
               "offset" if int(constant.sum()) >= 0.5 * columns.numel() else "other")
    return n_broken, out.numel(), pattern, size / scale if scale > 0 else float("inf")


def scale_pattern(ref: torch.Tensor, scaled: torch.Tensor, broken: torch.Tensor) -> str:
    """identities.scale_pattern: zero, clip, offset or other."""
    a, b = ref[broken].to(torch.float64), scaled[broken].to(torch.float64)
    if int(((a == 0) | (b == 0)).sum()) >= 0.5 * a.numel():
        return "zero"
    mags = torch.cat([a.abs(), b.abs()])
    _, counts = torch.unique(mags, return_counts=True)
    if a.numel() >= 4 and int(counts.max()) >= 0.25 * a.numel():
        return "clip"
    if int(broken.sum()) >= 0.5 * broken.numel():
        diff = scaled.to(torch.float64) - ref.to(torch.float64)
        mean_c = diff.mean(dim=0).abs()
        spread_c = diff.std(dim=0, unbiased=False)
        if _median(mean_c / torch.clamp(spread_c, min=1e-30)) > 3.0:
            return "offset"
    return "other"


def causal_check(ref: torch.Tensor, out: torch.Tensor, positions: torch.Tensor, cut: int
                 ) -> tuple[int, int, float]:
    """identities.causal_check."""
    if ref.shape != out.shape or positions.numel() != ref.shape[0]:
        return 0, 0, 0.0
    before = positions < cut
    a, b = ref[before], out[before]
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    moved = same.numel() - int(same.sum())
    return moved, same.numel(), relative_distance(b, a) if moved else 0.0


def _identities(out: dict, x: torch.Tensor, rows: torch.Tensor, row_pos, probes, dtype) -> None:
    scaled = {int(p.param): _rows(p.data) for p in probes if p.kind == "scale"}
    if 0 in scaled:
        worst = (0.0, 0, "", 0.0)
        for k, data in scaled.items():
            if k:
                broken, judged, pattern, size = scale_check(scaled[0], data, k, dtype)
                frac = broken / judged if judged else 0.0
                if judged and (frac > worst[0] or not worst[1]):
                    worst = (frac, judged, pattern, size)
        if worst[1]:
            out.update(zip(s.SCALE_COLUMNS, (worst[0], worst[1],
                                             s.SCALE_PATTERNS.index(worst[2]), worst[3])))
    for p in probes:
        if p.kind == "zero":  # an expert's zero identity: held in the scale columns
            broken, judged, pattern, size = zero_check(_rows(p.data), x[rows])
            out.update(zip(s.SCALE_COLUMNS, (broken / judged if judged else 0.0, judged,
                                             s.SCALE_PATTERNS.index(pattern), size)))
    refs = []
    if row_pos is not None and any(p.kind == "causal" for p in probes):
        refs = [_rows(p.data) for p in probes if p.kind in ("replay", "repeat")] + [x[rows]]
    for p in probes:
        if p.kind == "causal" and row_pos is not None:  # signals._identities says why min
            out_rows = _rows(p.data)
            checks = [causal_check(ref, out_rows, row_pos, int(p.param))
                      for ref in refs if ref.shape == out_rows.shape]
            moved, judged, size = min(checks, default=(0, 0, 0.0))
            if judged:
                out.update(zip(s.CAUSAL_COLUMNS, (moved / judged, judged, size)))
        elif p.kind == "host":
            device = (x[rows] if p.subset else x).to("cpu")
            host = _rows(p.data).to("cpu")
            out["host_red"] = relative_distance(device, host)
            out["host_channel_red"] = channel_distance(device, host)


def _probes(out: dict, clean: torch.Tensor, probes: list[ProbeRows], acc: torch.dtype) -> None:
    refs = [_rows(p.data) for p in probes if p.kind == "replay"]
    ref = refs[0] if refs else clean
    if refs and ref.shape == clean.shape:
        out.update(zip(s.BATCH_COLUMNS, batch_dependence(ref, clean)))
    top_sigma = max((float(p.param) for p in probes if p.kind == "gain"), default=0.0)
    top_sigma = max(top_sigma, 0.0)
    flat = None  # unmoved by every top-sigma gain draw and dc shift so far (None: all)
    # the draws of a kind in one stacked tensor: a few ops for all of them (each torch call
    # costs microseconds on the CPU, whatever its size)
    gains = [p for p in probes if p.kind == "gain" and p.pert_rms > 0
             and p.data.numel() == ref.numel()]
    if gains:
        d = torch.stack([_rows(p.data) for p in gains]) - ref
        c = d.reshape(len(gains), -1).to(acc)
        c = c - c.sum(dim=1, keepdim=True) / c.shape[1]
        stds = torch.sqrt((c * c).sum(dim=1) / c.shape[1]).tolist()
        for p, std in zip(gains, stds):
            out[s.gain_column(p.param, p.probe)] = std / p.pert_rms
        top = [i for i, p in enumerate(gains) if p.param == top_sigma]
        if top:
            flat = (d[top] == 0).all(dim=0)
    drawn = [p for p in probes if p.kind == "gain"]
    null = bool(drawn) and all(p.pert_rms == 0 for p in drawn)  # signals._probes: no shift
    for p in probes:
        if p.kind != "dc" or null:
            continue
        d = (_rows(p.data) - ref).abs()
        all_ok = _all_finite(d)
        ok = None if all_ok else torch.isfinite(d)
        if not all_ok and not bool(ok.any()):
            continue
        dead = d == 0
        flat = dead if flat is None else flat & dead
        flat_zero = flat & (ref == 0)
        # array_stats.at_clip_limit: a clipped value sits where a clip limit puts values
        clipped = flat & (ref != 0)
        if bool(clipped.any()):  # the usual case: no flat non-zero element, nothing to test
            clipped &= _at_clip_limit(ref)
        if all_ok:
            d_ok = d.reshape(-1)
        else:
            d_ok, dead, clipped, flat_zero = d[ok], dead[ok], clipped[ok], flat_zero[ok]
        med = _median(d_ok)
        counts = torch.stack([dead.sum(), clipped.sum(), flat_zero.sum(),
                              (d_ok < DC_LOW * med).sum()]).tolist()
        size = d_ok.numel()
        low = counts[3] / size if med > 0 else 1.0
        values = (counts[0] / size, counts[2] / size, counts[1] / size, size, low)
        out.update((s.dc_column(p.param, part), v) for part, v in zip(s.DC_PARTS, values))
    repeats = [p for p in probes if p.kind == "repeat" and p.data.numel() == clean.numel()]
    if not repeats or not clean.numel():
        return
    d = (torch.stack([_rows(p.data) for p in repeats]) - clean).reshape(len(repeats), -1)
    if not _all_finite(d):
        d = torch.where(torch.isfinite(d), d, 0.0)
    scale = _rms(clean, acc)
    n = d.shape[1]
    changed = (d != 0).sum(dim=1).tolist()
    d64 = d.to(acc)
    squares = (d64 * d64).sum(dim=1).tolist()
    for p, moved, square in zip(repeats, changed, squares):
        # the usual case: the repeat is bit-identical, its rms is 0
        d_rms = math.sqrt(square / n) if moved else 0.0
        out[s.repeat_column(p.probe, "instability")] = d_rms / scale if scale > 0 else NAN
        out[s.repeat_column(p.probe, "changed")] = moved / n
    moved_rows = [i for i, moved in enumerate(changed) if moved]
    if moved_rows:
        out.update(_moments(d[moved_rows].reshape(-1), acc, prefix="diff_"))


def _at_row_extreme(rows: torch.Tensor) -> torch.Tensor:
    finite = torch.isfinite(rows)
    top = torch.where(finite, rows, -torch.inf).amax(dim=-1, keepdim=True)
    bottom = torch.where(finite, rows, torch.inf).amin(dim=-1, keepdim=True)
    return finite & ((rows == top) | (rows == bottom))


def _at_clip_limit(rows: torch.Tensor) -> torch.Tensor:
    """array_stats.at_clip_limit: at the row's extreme, or at the channel's extreme held by
    two distinct rows of CLIP_MIN_ROWS, in a channel not constant and spanning TIE_MIN_LEVELS
    steps."""
    out = _at_row_extreme(rows)
    finite = torch.isfinite(rows)
    distinct = unique_rows(torch.where(finite, rows, 0.0))
    if distinct.shape[0] < CLIP_MIN_ROWS:
        return out
    top = torch.where(finite, rows, -torch.inf).amax(dim=0)
    bottom = torch.where(finite, rows, torch.inf).amin(dim=0)
    moving = top > bottom
    tied = [moving & ((distinct == ext).sum(dim=0) >= 2) for ext in (top, bottom)]
    for ext, held, wide in zip((top, bottom), tied, _wide(rows, finite, top, bottom)):
        out |= finite & (rows == ext) & held & wide
    return out


def _wide(rows: torch.Tensor, finite: torch.Tensor, top: torch.Tensor, bottom: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """array_stats._spans >= TIE_MIN_LEVELS: the channels spanning enough steps of their values'
    precision at their top and at their bottom. ``span_levels`` runs in float64 on the host
    (an NPU or MPS has no float64): three vectors of the width cross, not the rows."""
    bits = torch.where(finite, rows, 0.0).to(torch.float32).contiguous().view(torch.int32)
    bits = bits & 0x7FFFFF
    # the lowest mantissa bit any value of a channel uses (torch has no or-reduction: the
    # lowest bit of the values' or is the smallest of their lowest bits)
    own = bits & (-bits)
    lowest = torch.where(own > 0, own, 1 << 23).amin(dim=0).cpu().numpy()
    levels = span_levels(lowest, top.cpu().numpy(), bottom.cpu().numpy())
    return tuple(torch.from_numpy(v >= TIE_MIN_LEVELS).to(top.device) for v in levels)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return _as_float(t).reshape(-1, t.shape[-1])
