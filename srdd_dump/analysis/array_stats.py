"""Array statistics behind the reference-free signals: pure numpy, one array in, numbers out.

Several re-implement a numpy call with the same arithmetic because the call's overhead or
algorithm dominated the compare time; each says what it measured.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..vocabulary import (
    CLIP_MIN_ROWS,
    GRID_LEVELS,
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
from .sums import dot, total


def rms(x: np.ndarray) -> float:
    if not x.size:
        return float("nan")
    return rms64(x.reshape(-1).astype(np.float64, copy=False))


def rms64(x: np.ndarray) -> float:
    """``rms`` of a 1-D float64 array."""
    if not x.size:
        return float("nan")
    with np.errstate(over="ignore", invalid="ignore"):
        return math.sqrt(dot(x, x) / x.size)


def std(x: np.ndarray) -> float:
    """``np.std(x)`` in float64: the mean, then the squared deviations from it."""
    if not x.size:
        return float("nan")
    c = x.reshape(-1).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        c -= total(c) / c.size
        return math.sqrt(dot(c, c) / c.size)


def fraction(mask: np.ndarray) -> float:
    """``np.mean(mask)`` of a boolean array, without converting it to float64."""
    return int(np.count_nonzero(mask)) / mask.size if mask.size else float("nan")


def pileup(x: np.ndarray, bins: int = PILEUP_BINS,
           extremes: tuple[np.ndarray, np.ndarray] | None = None) -> float:
    """Edge-bin pile-up of ``np.histogram(x, bins)`` (``x``: finite values).

    Only bins 0, 2, 3 and -4, -3, -1 are used. Each is counted by comparing ``x`` with numpy's
    own edges (same linspace, same dtype): numpy's histogram puts a value in bin i exactly when
    edges[i] <= x < edges[i + 1] (the last bin closed). Two passes over ``x`` take the values
    of the four outer bins each side, the counts come from those; binning them costs far more
    when one huge outlier puts nearly every value there. ``extremes``: ``channel_extremes`` of
    2-D ``x`` (rows): the outer bins' values are then taken from the channels that reach them
    only (an activation's range is set by a few outlier channels: a tenth of the passes)."""
    if x.size < 10 * bins:
        return float("nan")
    if extremes is not None:
        lo, hi = extremes[1].min(), extremes[0].max()
    else:
        x = x.reshape(-1)
        lo, hi = x.min(), x.max()
    if lo == hi:
        return float("nan")
    dtype = np.result_type(lo, hi, x)
    edges = np.linspace(lo, hi, bins + 1, endpoint=True, dtype=dtype)
    if np.any(edges[:-1] >= edges[1:]):
        return float("nan")  # a range of a few ulps: no 100 distinct bins (numpy refuses too)
    x = x.astype(dtype, copy=False)
    low_in, high_in = x, x
    if extremes is not None:
        low_in = _columns_reaching(x, extremes[1] < edges[4])
        high_in = _columns_reaching(x, extremes[0] >= edges[bins - 4])
    # the values of the four outer bins each side, taken once; their counts from those
    low, high = low_in[low_in < edges[4]], high_in[high_in >= edges[bins - 4]]
    below = [np.count_nonzero(low < edges[k]) for k in (1, 2, 3)] + [low.size]
    above = [high.size] + [np.count_nonzero(high >= edges[k])
                           for k in (bins - 3, bins - 2, bins - 1)]
    left_edge, left = below[0], ((below[2] - below[1]) + (below[3] - below[2])) / 2
    right_edge, right = above[3], ((above[0] - above[1]) + (above[1] - above[2])) / 2
    return float(max(right_edge / max(1.0, right), left_edge / max(1.0, left)))


def _columns_reaching(rows: np.ndarray, reaching: np.ndarray) -> np.ndarray:
    """The columns of 2-D ``rows`` where ``reaching`` holds, or every column when most do."""
    columns = np.flatnonzero(reaching)
    return rows[:, columns] if columns.size < rows.shape[1] // 2 else rows


def median(x: np.ndarray) -> float:
    """``np.median`` of a 1-D array without NaN, through a sort: numpy's vectorised sort beats
    its partition (introselect) by about 4x on AVX-512; the middle values are the same."""
    n = x.size
    if not n:
        return float("nan")
    half = n // 2
    middle = _middle(x) if n >= SELECT_MIN else None
    if middle is None:
        ordered = np.sort(x)
        middle = ordered[half - 1: half + 1] if n % 2 == 0 else ordered[half: half + 1]
    if n % 2:
        return float(middle[-1])
    # np.mean of the two middle values, in their dtype (numpy's median), without its overhead
    return float((middle.sum(dtype=middle.dtype)) / middle.dtype.type(2))


SELECT_MIN = 8192  # values from which median() selects the middle ones instead of sorting
_SAMPLE = 2048  # values of a median's first guess


def _middle(x: np.ndarray) -> np.ndarray | None:
    """The values of ranks n // 2 - 1 and n // 2 (one: rank n // 2 when n is odd) of a 1-D
    array without NaN, as sorted ``x`` holds them, or None (then sort). A sample's quantiles
    bracket the middle; the values outside the bracket are only counted, the few inside
    sorted: the same values as a full sort (which cost 0.5 ms for 23,000 float32 values, a
    quarter of a probed round's compare), found in about a fifth of its time."""
    n = x.size
    half = n // 2
    first = half - 1 if n % 2 == 0 else half  # rank of the lower middle value
    sample = np.sort(x[:: max(1, n // _SAMPLE)])
    m = sample.size
    # +- 4 standard deviations of a sample median's rank
    spread = int(4 * math.sqrt(m) / 2) + 2
    lo = sample[max(0, m // 2 - spread)]
    hi = sample[min(m - 1, m // 2 + spread)]
    below = int(np.count_nonzero(x < lo))
    inside = x[(x >= lo) & (x <= hi)]
    if below > first or below + inside.size <= half:
        return None  # the middle is outside the bracket
    inside.sort()
    return inside[first - below: half - below + 1]


def percentile(x: np.ndarray, q: float) -> float:
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


def distinct_rows(rows: np.ndarray) -> bool:
    """True when no two rows are equal (as ``np.unique(rows, axis=0)`` compares them): some
    column holds ``len(rows)`` distinct values. False means "maybe": use np.unique."""
    n, width = rows.shape
    if n < 2:
        return True
    columns = sorted({0, width // 4, width // 2, 3 * width // 4, width - 1})
    picked = np.sort(rows[:, columns], axis=0)  # the columns sorted at once
    if rows.dtype.kind != "f" or not np.isnan(picked[-1]).any():  # NaN sorts last
        # np.unique's count of each column is n when no two neighbours are equal
        return bool(np.any(np.all(picked[1:] != picked[:-1], axis=0)))
    for j in columns:
        if np.unique(rows[:, j]).size == n:
            return True
    return False


def unique_index(rows: np.ndarray) -> np.ndarray | None:
    """The index of the first of each set of equal rows, ascending; None when no two rows are
    equal (the usual case, proved by one column)."""
    if distinct_rows(rows):
        return None
    if rows.dtype.kind == "f" and (np.isnan(rows).any() or (np.signbit(rows) & (rows == 0)).any()):
        # equal values with other bytes (NaN, -0.0)
        return np.sort(np.unique(rows, axis=0, return_index=True)[1])
    # equal rows are equal bytes: a set of them (np.unique(axis=0) sorts the rows as records,
    # 2 ms for 60 rows of 576 values)
    rows = np.ascontiguousarray(rows)
    first: dict[bytes, int] = {}
    for i, row in enumerate(rows):
        first.setdefault(row.tobytes(), i)
    return np.fromiter(first.values(), dtype=np.int64, count=len(first))


def unique_rows(rows: np.ndarray) -> np.ndarray:
    """The rows with duplicates removed; order does not matter to the callers."""
    keep = unique_index(rows)
    return rows if keep is None else rows[keep]


def distinct_tokens(ids: np.ndarray) -> int:
    """How many different token ids ``ids`` holds."""
    return int(np.unique(ids).size)


def _near_copies(rows: np.ndarray, tied: np.ndarray) -> bool:
    """The tied tokens are copies of each other beyond the tied channel: exactly equal on many
    channels (a head whose attention put all weight on one token: its value vector, copied),
    or spread over the other channels under a tenth of all tokens' spread (a uniform
    attention). A clip ties tokens that differ elsewhere."""
    if np.count_nonzero(tied) < 2:
        return False
    group = rows[tied]
    width = rows.shape[1]
    equal = np.count_nonzero(group.max(axis=0) == group.min(axis=0))
    if equal >= max(8, 0.05 * width):
        return True
    spread_all = float(np.median(rows.std(axis=0)))
    return spread_all > 0 and float(np.median(group.std(axis=0))) < 0.1 * spread_all


def _levels(col: np.ndarray, top: float, bottom: float) -> float:
    """(top - bottom) in steps of the values' own precision at ``top``: the precision is read
    from the low mantissa bits the float32 values use (bf16 values leave 16 of them 0)."""
    low = int(np.bitwise_or.reduce(np.ascontiguousarray(col, np.float32).view(np.uint32)
                                   & np.uint32(0x7FFFFF)))
    zeros = (low & -low).bit_length() - 1 if low else 23
    step = float(np.spacing(np.float32(abs(top)))) * 2.0 ** zeros
    return abs(float(top) - float(bottom)) / step if step > 0 else float("inf")


def channel_extremes(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(max, min) of each channel (column) of 2-D ``rows``."""
    return rows.max(axis=0), rows.min(axis=0)


def ties(rows: np.ndarray, candidates: int = TIE_CANDIDATES, distinct: bool = False,
         extremes: tuple[np.ndarray, np.ndarray] | None = None,
         ids: np.ndarray | None = None) -> tuple[float, float]:
    """(count, excess) of the channel whose exact maximum (if > 0) or minimum (if < 0) is
    shared by the most tokens, judged by excess.

    count: tokens at that extreme. excess: count / the mean count of the next two distinct
    values inward (at least 1). Null model: near its extreme a healthy channel's values come
    from a density that falls toward the tail, quantised at the dtype's spacing, so the extreme
    holds no more values than its neighbours (excess <= ~1-2, whatever the number of tokens);
    a clip puts every value beyond the limit on one value. A channel spanning fewer than
    TIE_MIN_LEVELS quantisation steps, or whose tied tokens are copies of each other in other
    channels (``_near_copies``), is not judged. Identical rows (a prompt prefix
    repeated across a batch, pad rows) are counted once. ``ids``: each row's token id where
    known: the excess then counts different tokens (at the extreme and at the values inward),
    since the repeats of one token early in a model are near-copies that round to one value
    (a prompt repeating a sentence). ``rows`` are finite; ``distinct``: they are already
    ``unique_rows`` (``ids`` with them), with ``extremes`` their ``channel_extremes`` if
    given."""
    if not distinct:
        keep = unique_index(rows)
        if keep is not None:
            rows, ids = rows[keep], None if ids is None else ids[keep]
    if ids is not None and ids.shape[0] != rows.shape[0]:
        ids = None
    if rows.shape[0] < 2:
        return float("nan"), float("nan")
    hi, lo = extremes if extremes is not None and distinct else channel_extremes(rows)
    at_hi = np.where(hi > 0, _count_at(rows, hi), 1)
    at_lo = np.where(lo < 0, _count_at(rows, lo), 1)
    count = int(max(at_hi.max(), at_lo.max()))
    if count < 2:
        return float(count), 1.0
    # the candidates: the channels with the most tokens at their extreme, by token where the
    # ids are known (repeats of one token in many channels must not crowd a clip out)
    rank_hi, rank_lo = at_hi, at_lo
    if ids is not None and distinct_tokens(ids) < ids.size:
        rank_hi = np.where(hi > 0, _tokens_at(rows, hi, ids), 1)
        rank_lo = np.where(lo < 0, _tokens_at(rows, lo, ids), 1)
    best = (1.0, 1)
    for at, rank, ext, sign in ((at_hi, rank_hi, hi, 1.0), (at_lo, rank_lo, lo, -1.0)):
        for c in np.argsort(-rank, kind="stable")[:candidates]:  # ties: the lower channel
            n = int(at[c])
            if rank[c] < 2:
                break
            col = rows[:, c] * sign
            inner = col[col < ext[c] * sign]
            values, counts = np.unique(inner, return_counts=True)
            if values.size and _levels(col, ext[c] * sign, values[0]) < TIE_MIN_LEVELS:
                continue  # a channel spanning a few quantisation steps: its extreme holds many
            tied = col == ext[c] * sign
            if _near_copies(rows, tied):
                continue  # tokens alike in every channel (a uniform attention), not a clip
            if ids is not None:
                n = distinct_tokens(ids[tied])
                if n < 2:
                    continue  # one token's repeats
                counts = np.array([distinct_tokens(ids[col == v]) for v in values[-2:]])
            if _by_chance(n, col, ext[c] * sign, inner, rows.shape[1]):
                continue  # as many as the channel's density near its extreme puts there
            neighbours = float(np.mean(counts[-2:])) if counts.size else 1.0
            best = max(best, (n / max(1.0, neighbours), n))
    return float(count), float(best[0])


def lowbits_by_value(values: np.ndarray, mask: int) -> float:
    """The share of the distinct non-zero float32 ``values`` whose ``mask`` bits are all 0
    (vocabulary.LOWBITS_BY_VALUE: the copies of a clip limit count once)."""
    distinct = np.unique(values[values != 0])
    if not distinct.size:
        return float("nan")
    return np.count_nonzero((distinct.view(np.uint32) & np.uint32(mask)) == 0) / distinct.size


def _by_chance(n: int, col: np.ndarray, top: float, inner: np.ndarray, width: int) -> bool:
    """vocabulary.ties_by_chance of ``n`` tokens at ``top`` in one of ``width`` channels, the
    density read from the values next inward (``inner``: the column's values below ``top``)."""
    if not inner.size:
        return False
    nearest = np.sort(inner)[-TIE_DENSITY_VALUES:]
    return ties_by_chance(n, nearest.size, _levels(col, top, float(nearest[0])), width)


def _tokens_at(rows: np.ndarray, extreme: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Per column, the different tokens (``ids``, one per row) whose row equals ``extreme``."""
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    equal = rows[order] == extreme
    return np.logical_or.reduceat(equal, starts, axis=0).sum(axis=0)


def _count_at(rows: np.ndarray, extreme: np.ndarray) -> np.ndarray:
    """Per column, the rows equal to ``extreme`` (a value of each column of ``rows``): int32.
    Usually every column holds its extreme once, which one count proves; else the counts are
    summed as bytes (half the time of a sum of booleans into int32)."""
    equal = rows == extreme
    if np.count_nonzero(equal) == rows.shape[1]:
        return np.ones(rows.shape[1], dtype=np.int32)
    wide = np.uint16 if rows.shape[0] < 1 << 16 else np.int32
    return np.add.reduce(equal.view(np.uint8), axis=0, dtype=wide).astype(np.int32)


def batch_dependence(ref: np.ndarray, clean: np.ndarray) -> tuple[float, float, float]:
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
    level = median(np.abs(clean[moved])) / top
    return worst / top, level, np.count_nonzero(moved) / d.size


def channel_signals(u: np.ndarray, out: np.ndarray, distinct: bool = False,
                    extremes: tuple[np.ndarray, np.ndarray] | None = None
                    ) -> tuple[float, float, float]:
    """Token-constant structure per channel: (dc energy, consistency, stuck), NaN where not
    measured. ``u`` is the update with non-finite values set to 0, as float64 rows; ``out``
    the output rows. dc energy: ||token mean of u||^2 / mean ||u row||^2; consistency: the
    99th percentile over live channels of |mean_t u_c| / rms_t u_c (a bias); stuck: the
    fraction of channels at one non-zero value over every distinct token (``distinct``: the
    output rows are already ``unique_rows``, with ``extremes`` their ``channel_extremes`` if
    given)."""
    nan = float("nan")
    if u.shape[0] < 4:
        return nan, nan, nan
    mean_c = u.mean(axis=0)
    sq_c = np.einsum("ij,ij->j", u, u)  # per-channel sum of squares, no u * u temporary
    rms_c = np.sqrt(sq_c / u.shape[0])
    per_token = float(sq_c.sum()) / u.shape[0]  # mean over tokens of the sum of squares
    dce = float(np.sum(mean_c**2)) / per_token if per_token > 0 else nan
    live = rms_c > 0
    cons = percentile(np.abs(mean_c[live]) / rms_c[live], 0.99) if live.any() else nan
    # constant non-zero channels; constant zero channels count as exact zeros (dead zone)
    out = out if distinct else unique_rows(out)
    if out.shape[0] < stuck_min_tokens(out.shape[1]):
        return dce, cons, nan
    hi, lo = extremes if extremes is not None and distinct else channel_extremes(out)
    with np.errstate(invalid="ignore"):  # inf - inf
        constant = ((hi - lo) == 0) & (out[0] != 0)  # np.ptp(out, axis=0) == 0
    return dce, cons, fraction(constant)


def at_row_extreme(rows: np.ndarray) -> np.ndarray:
    """Elements equal to their row's largest or smallest finite value (where a clip limit puts
    the values it clips)."""
    finite = np.isfinite(rows)
    if finite.all():  # the usual case: no masking copies
        return (rows == rows.max(axis=-1, keepdims=True)) | (
            rows == rows.min(axis=-1, keepdims=True))
    with np.errstate(invalid="ignore"):
        top = np.max(np.where(finite, rows, -np.inf), axis=-1, keepdims=True)
        bottom = np.min(np.where(finite, rows, np.inf), axis=-1, keepdims=True)
    return finite & ((rows == top) | (rows == bottom))


def at_clip_limit(rows: np.ndarray) -> np.ndarray:
    """Elements where a clip limit puts what it clips: at their row's largest or smallest
    finite value (``at_row_extreme``), or at their channel's (column's) when the channel's
    extreme is held by at least two of CLIP_MIN_ROWS or more distinct rows and the channel
    spans TIE_MIN_LEVELS quantisation steps or more. A limit on some channels only leaves
    larger values in the row's other channels, but puts every token beyond it on the
    channel's extreme. Not counted: a channel constant over the tokens (stuck, not clipped)
    and one spanning a few rounding steps (its extremes hold many values: ``ties``); values
    a coarse rounding grid leaves unmoved lie anywhere, rarely at such a place."""
    out = at_row_extreme(rows)
    if rows.ndim != 2:
        return out
    finite = np.isfinite(rows)
    all_finite = bool(finite.all())
    distinct = unique_rows(rows if all_finite else np.where(finite, rows, 0.0))
    if distinct.shape[0] < CLIP_MIN_ROWS:
        return out
    if all_finite:
        top, bottom = rows.max(axis=0), rows.min(axis=0)
    else:
        with np.errstate(invalid="ignore"):
            top = np.max(np.where(finite, rows, -np.inf), axis=0)
            bottom = np.min(np.where(finite, rows, np.inf), axis=0)
    moving = top > bottom
    tied = [moving & (np.count_nonzero(distinct == ext, axis=0) >= 2) for ext in (top, bottom)]
    columns = np.flatnonzero(tied[0] | tied[1])
    if not columns.size:
        return out
    # the spans of the tied channels only (each channel's is its own)
    spans = _spans(rows[:, columns], top[columns], bottom[columns])
    for ext, held, span in zip((top, bottom), tied, spans):
        held[columns] &= span >= TIE_MIN_LEVELS
        if held.any():
            out |= (rows == ext) & held if all_finite else finite & (rows == ext) & held
    return out


def _spans(rows: np.ndarray, top: np.ndarray, bottom: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """``vocabulary.span_levels`` of each channel of ``rows`` (``_levels`` of every column at
    once)."""
    with np.errstate(invalid="ignore", over="ignore"):
        wide = np.ascontiguousarray(np.where(np.isfinite(rows), rows, 0.0), np.float32)
    low = np.bitwise_or.reduce(wide.view(np.uint32) & np.uint32(0x7FFFFF), axis=0)
    lowest = np.where(low > 0, low & (~low + np.uint32(1)), np.uint32(1 << 23))
    return span_levels(lowest, top, bottom)


def rows_of(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, x.shape[-1])




def nanmedian(values: list[float]) -> float:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    return median(v)  # np.median's value (tests/test_fastpaths.py) without its overhead


def nanmax(values: list[float]) -> float:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(np.max(v)) if v.size else float("nan")


def mad(values: list[float]) -> float:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(1.4826 * np.median(np.abs(v - np.median(v)))) if v.size else float("nan")



@functools.lru_cache(maxsize=256)
def _grid_picks(n: int) -> np.ndarray:
    """``grid_row_picks(n)``, computed once per row count (read-only)."""
    picks = grid_row_picks(n)
    picks.setflags(write=False)
    return picks


GRID_HEAD = GRID_LEVELS + 2  # values of a row whose distinctness rules the grid out


def grid_rows(rows: np.ndarray, dtype: str) -> float:
    """The share of tested rows (vocabulary.grid_row_picks) whose distinct values lie on an
    8-bit grid (vocabulary.on_grid): the dequantised output of an 8-bit quantisation with a
    scale (and zero point) per row or per tensor. A row needs grid_min_values(dtype) non-zero
    values to be tested; NaN when none has."""
    if rows.ndim != 2 or not rows.shape[0]:
        return float("nan")
    eps = UNIT_ROUNDOFF.get(dtype, 2.0 ** -24)
    picked = rows[_grid_picks(rows.shape[0])]
    if np.isfinite(picked).all():  # the usual case: the rows sorted at once
        if picked.shape[1] > GRID_HEAD:
            # a float row holds more distinct values than a grid among its first ones: all
            # rows so are tested (more non-zero values than grid_min_values) and off the grid
            head = np.sort(picked[:, :GRID_HEAD], axis=1)
            if np.count_nonzero(head[:, 1:] != head[:, :-1]) == head.shape[0] * (GRID_HEAD - 1):
                return 0.0
        tested_rows = picked[np.count_nonzero(picked, axis=1) >= grid_min_values(dtype)]
        if not tested_rows.shape[0]:
            return float("nan")
        ordered = np.sort(tested_rows.astype(np.float64), axis=1)
        new = ordered[:, 1:] != ordered[:, :-1]  # np.unique's own test of a new value
        distinct = 1 + np.count_nonzero(new, axis=1)
        on = 0
        for row, is_new, n in zip(ordered, new, distinct.tolist()):
            # on_grid is False below 3 or above GRID_LEVELS + 1 distinct values
            if 3 <= n <= GRID_LEVELS + 1:
                on += on_grid(row[np.concatenate(([True], is_new))], eps)
        return on / tested_rows.shape[0]
    tested = on = 0
    for r in grid_row_picks(rows.shape[0]):
        v = rows[r]
        v = v[np.isfinite(v)]
        if np.count_nonzero(v) < grid_min_values(dtype):
            continue
        tested += 1
        on += on_grid(np.unique(v.astype(np.float64)), eps)
    return on / tested if tested else float("nan")
