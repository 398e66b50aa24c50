"""``signals.round_stats`` of many one-token records at once.

A decode step's records hold one token row each, and most of a dump's records are such rows
(an 8-sample SmolLM2 dump: 3,300 of its 4,800 clean records) without probes. Per record the
reductions are a few microseconds of arithmetic under some 100 us of call overhead; here every
row of one width and dtype is reduced in one pass of each kind. The numbers are
``round_stats``'s own: the same formulas, float64 sums in another order (a few ulps apart, as
``analysis.sums`` says of its two paths). A row with a non-finite value goes through
``round_stats`` itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..vocabulary import LOW_BITS_MASK, LOWBITS_BY_VALUE, PILEUP_BINS
from . import array_stats as st
from .moments import Moments
from .signals import RoundStats, round_stats


def one_row_stats(
    x: np.ndarray, dtype: str, samples: Sequence[int], before: np.ndarray | None = None,
) -> list[RoundStats]:
    """``round_stats(x[i][None, None], dtype, samples[i], before[i][None, None])`` of every
    row ``i`` of ``x`` (rows, width), each a clean one-token record without probes whose row
    the attention mask keeps; ``before``: the previous block's clean rows (blocks), or None."""
    x = np.asarray(x)
    n, width = x.shape
    update = x if before is None else x - before
    finite = np.isfinite(x).all(axis=1) & np.isfinite(update).all(axis=1)
    out: list[RoundStats | None] = [None] * n
    for i in np.flatnonzero(~finite).tolist():  # rare: masks and copies, as round_stats does
        prev = None if before is None else before[i][None, None]
        out[i] = round_stats(x[i][None, None], dtype, samples[i], prev)
    keep = np.flatnonzero(finite)
    if not keep.size:
        return out
    x, update = x[keep], update[keep]
    moments = _moments(x)
    pileups = _pileups(x) if width >= 10 * PILEUP_BINS else [math.nan] * keep.size
    u = update.astype(np.float64)
    upd_rms = np.sqrt(np.einsum("ij,ij->i", u, u) / width)
    offsets = np.abs(u.sum(axis=1) / width)
    lowbits = _lowbits(x, dtype)
    grids = _grids(x, dtype)
    for j, i in enumerate(keep.tolist()):
        r = RoundStats(sample=samples[i], dtype=dtype, moments=moments[j])
        r.rows = 1.0
        r.pileup = pileups[j]
        r.update_rms = float(upd_rms[j])
        r.offset = float(offsets[j]) / r.update_rms if r.update_rms > 0 else math.nan
        r.lowbits = lowbits[j]
        r.grid = grids[j]
        out[i] = r
    return out


def _moments(x: np.ndarray) -> list[Moments]:
    """``Moments().add(row)`` of each finite row."""
    width = x.shape[1]
    lo, hi = x.min(axis=1), x.max(axis=1)
    zeros = np.count_nonzero(x == 0, axis=1)
    d = x.astype(np.float64)
    mean = d.sum(axis=1) / width
    d -= mean[:, None]
    d2 = d * d
    m2 = d2.sum(axis=1)
    m3 = np.einsum("ij,ij->i", d2, d)
    m4 = np.einsum("ij,ij->i", d2, d2)
    out = []
    for row in zip(lo.tolist(), hi.tolist(), zeros.tolist(), mean.tolist(), m2.tolist(),
                   m3.tolist(), m4.tolist()):
        low, high, zero, mu, s2, s3, s4 = row
        m = Moments(count=width, absmax=max(abs(low), abs(high)), zeros=zero)
        if low == high:  # constant: exact zero spread (Moments' own rule)
            m.mean_ = low
        else:
            m.mean_, m.m2, m.m3, m.m4 = mu, s2, s3, s4
        out.append(m)
    return out


def _pileups(x: np.ndarray) -> list[float]:
    """``array_stats.pileup`` of each finite row (a row of 10 * PILEUP_BINS values or more)."""
    return [st.pileup(row) for row in x]


def _lowbits(x: np.ndarray, dtype: str) -> list[float]:
    mask = LOW_BITS_MASK.get(dtype)
    if mask is None or x.dtype != np.float32:
        return [math.nan] * x.shape[0]
    nonzero = x != 0
    nnz = np.count_nonzero(nonzero, axis=1)
    low = (np.ascontiguousarray(x).view(np.uint32) & np.uint32(mask)) == 0
    hits = np.count_nonzero(low & nonzero, axis=1)
    out = [h / z if z else math.nan for h, z in zip(hits.tolist(), nnz.tolist())]
    return [st.lowbits_by_value(row, mask) if share > LOWBITS_BY_VALUE else share
            for row, share in zip(x, out)]


def _grids(x: np.ndarray, dtype: str) -> list[float]:
    """``array_stats.grid_rows`` of each row as a one-row record: a row whose first values are
    all distinct is off any 8-bit grid (grid_rows' own shortcut); the others are tested."""
    head = st.GRID_HEAD
    if x.shape[1] <= head:
        return [st.grid_rows(row[None], dtype) for row in x]
    first = np.sort(x[:, :head], axis=1)
    distinct = np.count_nonzero(first[:, 1:] != first[:, :-1], axis=1) == head - 1
    return [0.0 if ok else st.grid_rows(row[None], dtype)
            for ok, row in zip(distinct.tolist(), x)]
