"""Whole-tensor statistics (count, max, min, mean, L2 norm: what msprobe's statistics mode
keeps) and what they prove about the difference of two tensors.

A statistics-only side has no elements to compare, but its statistics bound the relative
error from below: with g the golden tensor and m mine, both of n elements,

    | ||m|| - ||g|| |          <= ||m - g||        (triangle inequality)
    sqrt(n) |mean m - mean g|  <= ||m - g||        (Cauchy-Schwarz)
    |max m - max g|, |min m - min g| <= max |m - g| <= ||m - g||

so ``red_lower_bound`` = the largest of these over ||g|| is at most the relative Euclidean
distance RED = ||m - g|| / ||g||. A mean or norm recorded in a low-precision dtype (msprobe
computes them in the tensor's dtype: a bf16 norm is rounded to 8 bits) is known only to within
its rounding, ``precision`` (relative to the norm, and for the mean to the root mean square,
which bounds the rounding of a computed mean); that much of each gap is not counted. A max and a min
are values of the tensor, so exact. A bound above a FAIL limit proves the FAIL; a bound under
it proves nothing more (a change that keeps these statistics, e.g. two values swapped, is not
seen). Pure numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .metrics import SideStats
from .tolerance import UNIT_ROUNDOFF

# a recorded mean or norm: rounded once when accumulated, once when stored (in units of the
# dtype's unit roundoff)
RECORDED_ROUNDING = 2.0


@dataclass
class TensorSummary:
    """Statistics of one tensor; NaN where a side does not know one (an srdd stats dump keeps
    the moments and |max|, not max and min)."""

    n: int = 0
    max: float = math.nan
    min: float = math.nan
    mean: float = math.nan
    norm: float = math.nan
    nonfinite: int = 0  # NaN/Inf elements
    precision: float = 0.0  # relative rounding of the recorded mean and norm (0: exact here)

    def values(self) -> tuple[float, float, float]:
        """(max, min, mean), the msit report's columns."""
        return self.max, self.min, self.mean


def from_side(side: SideStats) -> TensorSummary:
    """The summary of a tensor read here (metrics.SideStats: exact, float64)."""
    max_, min_, mean = side.values()
    norm = math.sqrt(side.squares) if side.count else math.nan
    return TensorSummary(n=side.count, max=max_, min=min_, mean=mean, norm=norm,
                         nonfinite=side.nonfinite)


def from_stats(n: float, max_: float, min_: float, mean: float, norm: float,
               m2: float = math.nan, nonfinite: int = 0, dtype: str = "float32"
               ) -> TensorSummary:
    """A summary from statistics recorded in ``dtype`` (NaN: not recorded); the norm from the
    moments when it was not recorded itself."""
    if math.isnan(norm) and math.isfinite(m2) and math.isfinite(mean) and n > 0:
        norm = math.sqrt(max(m2 + n * mean * mean, 0.0))
    return TensorSummary(n=int(n) if math.isfinite(n) else 0, max=max_, min=min_, mean=mean,
                         norm=norm, nonfinite=nonfinite,
                         precision=RECORDED_ROUNDING * UNIT_ROUNDOFF.get(dtype, 2.0**-24))


def red_lower_bound(mine: TensorSummary, golden: TensorSummary) -> float:
    """The largest relative error the two summaries prove (module docstring); NaN when
    nothing can be said (no golden norm, or no statistic known on both sides)."""
    if not (math.isfinite(golden.norm) and golden.norm > 0):
        return math.nan

    def gap(a: float, b: float, scale_a: float, scale_b: float) -> float:
        """|a - b| less what the rounding of a and of b (relative to their scales) explains."""
        slack = mine.precision * scale_a + golden.precision * scale_b
        return max(abs(a - b) - slack, 0.0)

    gaps = [gap(mine.norm, golden.norm, mine.norm, golden.norm),
            abs(mine.max - golden.max), abs(mine.min - golden.min)]
    if mine.n == golden.n and mine.n > 0:
        # a computed mean's rounding scales with the values' magnitude, not with the mean:
        # the root mean square bounds it
        rms_mine, rms_golden = (s.norm / math.sqrt(s.n) for s in (mine, golden))
        gaps.append(math.sqrt(mine.n) * gap(mine.mean, golden.mean, rms_mine, rms_golden))
    known = [g for g in gaps if math.isfinite(g)]
    return max(known) / golden.norm if known else math.nan
