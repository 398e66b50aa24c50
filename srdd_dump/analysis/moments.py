"""Streaming per-layer statistics: exact float64 moments merged chunk by chunk.

Each chunk gets an exact two-pass computation of its mean and central sums M2..M4; chunks are
then combined with the pairwise update of Chan et al. and Pebay (2008), so the result does not
depend on how the data was split and never needs the whole layer in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .sums import dot, total

BLOCK = 1 << 20  # elements converted to float64 at a time (8 MiB)


@dataclass
class Moments:
    """Count, mean, central sums M2..M4 and value counters of a stream of arrays.

    NaN and +-Inf are counted in ``nan_count`` / ``inf_count`` and left out of everything else;
    ``count``, ``zeros`` and ``absmax`` refer to the finite values only. ``m3``, ``m4`` and
    ``zeros`` are NaN where a source did not record them (statistics converted from msprobe).
    """

    count: int = 0
    mean_: float = 0.0
    m2: float = 0.0
    m3: float = 0.0
    m4: float = 0.0
    absmax: float = 0.0
    zeros: int | float = 0  # a count, NaN when unknown
    nan_count: int = 0
    inf_count: int = 0

    def add(self, array: np.ndarray, bounds: tuple[float, float] | None = None,
            wide: np.ndarray | None = None) -> Moments:
        """Fold in every element of ``array`` (any shape, any real dtype). Returns self.
        ``bounds``: the array's (min, max) when known (not looked for again in an array of at
        most ``BLOCK`` elements); ``wide``: with finite ones, the array already converted to
        float64 (read, not changed)."""
        flat = np.asarray(array).reshape(-1)
        if bounds is not None and flat.size <= BLOCK:
            return self.merge(_block_moments(flat, bounds, wide))
        for start in range(0, flat.size, BLOCK):
            self.merge(_block_moments(flat[start : start + BLOCK]))
        return self

    def merge(self, other: Moments) -> Moments:
        """Combine with the statistics of another, disjoint part of the data. Returns self."""
        self.nan_count += other.nan_count
        self.inf_count += other.inf_count
        na, nb = self.count, other.count
        if nb == 0:
            return self
        if na == 0:
            self.count, self.mean_ = nb, other.mean_
            self.m2, self.m3, self.m4 = other.m2, other.m3, other.m4
            self.absmax, self.zeros = other.absmax, other.zeros
            return self
        n = na + nb
        delta = other.mean_ - self.mean_
        d_n = delta / n
        d_n2 = d_n * d_n
        ab = float(na) * float(nb)
        term1 = delta * d_n * ab
        m2a, m3a = self.m2, self.m3
        self.m4 += (
            other.m4
            + term1 * d_n2 * (na * na - na * nb + nb * nb)
            + 6.0 * d_n2 * (na * na * other.m2 + nb * nb * m2a)
            + 4.0 * d_n * (na * other.m3 - nb * m3a)
        )
        self.m3 += other.m3 + term1 * d_n * (na - nb) + 3.0 * d_n * (na * other.m2 - nb * m2a)
        self.m2 += other.m2 + term1
        self.mean_ += d_n * nb
        self.count = n
        self.absmax = max(self.absmax, other.absmax)
        self.zeros += other.zeros
        return self

    @property
    def total(self) -> int:
        """All elements seen, finite or not."""
        return self.count + self.nan_count + self.inf_count

    @property
    def nonfinite(self) -> int:
        return self.nan_count + self.inf_count

    @property
    def mean(self) -> float:
        return self.mean_ if self.count else math.nan

    @property
    def var(self) -> float:
        """Population variance (ddof=0)."""
        return self.m2 / self.count if self.count else math.nan

    @property
    def std(self) -> float:
        """Population standard deviation (ddof=0), as ``numpy.std``."""
        return math.sqrt(self.var) if self.count else math.nan

    @property
    def kurtosis(self) -> float:
        """Excess (Fisher) kurtosis, 0 for a normal distribution and for constant data."""
        if not self.count:
            return math.nan
        if self.m2 <= 0.0:
            return 0.0
        return self.count * self.m4 / (self.m2 * self.m2) - 3.0

    @property
    def zero_frac(self) -> float:
        """Fraction of the finite values that are exactly zero (0 when there are none; NaN
        when the zeros were not counted)."""
        return self.zeros / self.count if self.count else 0.0


def _block_moments(block: np.ndarray, bounds: tuple[float, float] | None = None,
                   wide: np.ndarray | None = None) -> Moments:
    out = Moments()
    if block.size == 0:
        return out
    # NaN propagates through max and an Inf is the max or the min: two finite values prove
    # the block finite without a mask
    lo, hi = (float(bounds[0]), float(bounds[1])) if bounds is not None else (
        float(block.min()), float(block.max()))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        finite = np.isfinite(block)
        out.nan_count = int(np.count_nonzero(np.isnan(block)))
        out.inf_count = int(block.size - np.count_nonzero(finite)) - out.nan_count
        block = block[finite]
        if block.size == 0:
            return out
        lo, hi = float(block.min()), float(block.max())
    out.count = int(block.size)
    out.absmax = max(abs(lo), abs(hi))
    out.zeros = int(np.count_nonzero(block == 0))
    if lo == hi:  # constant: exact zero spread, whatever rounding sum()/n would add
        out.mean_ = lo
        return out
    if wide is not None:
        wide = wide.reshape(-1)
        out.mean_ = total(wide) / wide.size
        d = wide - out.mean_
    else:
        d = block.astype(np.float64)  # a copy, so the deviations can overwrite it
        out.mean_ = total(d) / d.size
        d -= out.mean_
    d2 = d * d
    out.m2 = total(d2)
    out.m3 = dot(d2, d)
    out.m4 = dot(d2, d2)
    return out
