"""msit/msprobe-compatible comparison metrics of two tensors, streamed in float64 blocks.

``g`` is the golden (baseline) tensor and ``m`` mine (the target), both flattened. Formulas
(msit ``llm compare`` unless noted; ``eps`` = float32 machine epsilon):

* cosine_similarity = g.m / (|g| |m|); 1.0 when both are all zero, NaN when only one is
* relative error per element = |m / g - 1| where |g| > eps, else 0; max and mean over all
* absolute error per element = |m - g|; max and mean
* kl_divergence = sum softmax(g) * (log_softmax(g) - log_softmax(m)) over the whole flattened
  tensor, clamped at 0 (log-softmax with max-subtraction, kept streaming as a running max)
* relative_euclidean_distance = sqrt(sum (m - g)^2 / sum g^2); 0 when |g| <= eps (msit)
* sqnr = 20 log10(|g| / |g - m|) in dB, +inf when m == g (PyTorch Numeric Suite)
* one_thousandth / five_thousandths_err_ratio = fraction of elements with
  |m - g| / |g| <= 0.001 / 0.005, |g| = 0 replaced by eps, in float64
* euclidean_distance = sqrt(sum (m - g)^2) (msprobe's EucDist)

``rules="msprobe"`` reproduces msprobe's own max_relative_error and thousandth ratios instead:
computed in the inputs' precision (float32 for fp32/bf16/fp16 data), eps of that precision
added to both sides where g == 0 (so the error there is |m| / eps), over every element, and the
ratios count a strict ``< 0.001`` / ``< 0.005``; NaN/Inf at the same positions count as equal
elements (msprobe zeroes them), at different positions make both NaN (msprobe's N/A).

NaN and Inf are compared by position (``nan_inf``); every other metric is computed over the
elements finite on both sides. ``PairStats`` accumulates all of them block by block, so a tensor
of any size is compared in constant memory; the functions below wrap it for whole arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .sums import dot, total

FP32_EPS = float(np.finfo(np.float32).eps)
BLOCK = 1 << 20  # elements per float64 block (8 MiB)
# numpy's vectorised float64 exp is 25x slower for inputs below about -708 and 300x slower where
# the result is subnormal. The log-sum-exp takes exp(x - peak) below EXP_FLUSH as 0: such terms
# are under 1.1e-307 of the peak's term (1.0), so they change the KL divergence by less than
# 1e-260 for float32 data (at most 2^20 terms per block, |m - g| < 7e38), while a layer with one
# large outlier puts nearly every element there.
EXP_FLUSH = -707.0


@dataclass
class NanInf:
    """NaN/Inf positions of both tensors: counts, and positions where they disagree."""

    golden: int = 0  # non-finite elements in g
    mine: int = 0  # non-finite elements in m
    mismatched: int = 0  # positions where the two differ (NaN vs finite, +Inf vs -Inf, ...)

    @property
    def any(self) -> bool:
        return bool(self.golden or self.mine)

    def describe(self) -> str:
        if not self.any:
            return ""
        if self.mismatched:
            return (
                f"NaN/Inf: golden {self.golden}, my {self.mine}, "
                f"{self.mismatched} positions differ"
            )
        return f"NaN/Inf at the same {self.golden} positions on both sides"


@dataclass
class SideStats:
    """max, min, mean and the sum of squares of one tensor's finite values (NaN when there are
    none)."""

    count: int = 0
    total: float = 0.0
    squares: float = 0.0
    max: float = -math.inf
    min: float = math.inf
    nonfinite: int = 0

    def add_raw(self, x: np.ndarray) -> SideStats:
        """Fold in any block: non-finite values are counted and left out."""
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        finite = np.isfinite(x)
        if not finite.all():
            self.nonfinite += int(x.size - finite.sum())
            x = x[finite]
        self.add(x)
        return self

    def add(self, x: np.ndarray) -> None:
        """Fold in finite values."""
        if x.size:
            self.count += x.size
            self.total += float(x.sum())
            self.squares += float(np.dot(x, x))
            self.max = max(self.max, float(x.max()))
            self.min = min(self.min, float(x.min()))

    def values(self) -> tuple[float, float, float]:
        if not self.count:
            return math.nan, math.nan, math.nan
        return self.max, self.min, self.total / self.count


@dataclass
class _LogSumExp:
    """Running log(sum exp(x)) with max-subtraction, plus sum exp(x - M) * w for a weight w."""

    peak: float = -math.inf
    total: float = 0.0  # sum exp(x - peak)
    weighted: float = 0.0  # sum exp(x - peak) * w

    def add(
        self, x: np.ndarray, w: np.ndarray | None = None, hi: float | None = None,
        lo: float | None = None,
    ) -> None:
        """Fold in ``x`` (finite, float64); ``hi``/``lo``: its max and min when known."""
        if not x.size:
            return
        peak = max(self.peak, float(x.max()) if hi is None else hi)
        scale = math.exp(self.peak - peak) if self.total else 0.0
        lo = float(x.min()) if lo is None else lo
        e, w = _exp_terms(x, peak, lo, w)
        self.total = self.total * scale + total(e)
        if w is not None:
            self.weighted = self.weighted * scale + dot(e, w)
        self.peak = peak

    @property
    def value(self) -> float:
        return self.peak + math.log(self.total) if self.total else -math.inf


def _exp_terms(
    x: np.ndarray, peak: float, lo: float, w: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """The terms exp(x - peak) that matter, with their weights ``w``; terms below
    exp(EXP_FLUSH) are 0 (see EXP_FLUSH). ``lo`` is ``x.min()``.

    Three cases: no term is that small (all computed); few terms are not (a layer with one
    large outlier keeps one: only those computed); else all computed, the small ones zeroed."""
    if lo - peak >= EXP_FLUSH:  # x - peak >= EXP_FLUSH everywhere (rounding is monotonic)
        y = x - peak
        return np.exp(y, out=y), w
    keep = np.flatnonzero(x >= peak + EXP_FLUSH)
    if keep.size <= x.size // 4:
        return np.exp(x[keep] - peak), None if w is None else w[keep]
    y = x - peak
    e = np.exp(np.maximum(y, EXP_FLUSH))  # exp of the clamped value stays fast
    e[y < EXP_FLUSH] = 0.0
    return e, w


METRIC_RULES = ("msit", "msprobe")


@dataclass
class PairStats:
    """Streaming accumulator of every metric of a (golden, mine) pair of equal-size tensors."""

    rules: str = "msit"  # or "msprobe": its max_relative_error and thousandth ratios
    n: int = 0  # elements finite on both sides
    n_ratio: int = 0  # elements the thousandth ratios count (msprobe: equal NaN/Inf too)
    gg: float = 0.0
    mm: float = 0.0
    gm: float = 0.0
    dd: float = 0.0  # sum (m - g)^2
    abs_max: float = 0.0
    abs_sum: float = 0.0
    rel_max: float = 0.0
    rel_sum: float = 0.0
    within_1e3: int = 0
    within_5e3: int = 0
    nan_inf: NanInf = field(default_factory=NanInf)
    golden: SideStats = field(default_factory=SideStats)
    mine: SideStats = field(default_factory=SideStats)
    _lse_g: _LogSumExp = field(default_factory=_LogSumExp)
    _lse_m: _LogSumExp = field(default_factory=_LogSumExp)

    def add(self, g: np.ndarray, m: np.ndarray) -> PairStats:
        """Fold in one block; ``g`` and ``m`` have the same number of elements."""
        g = np.asarray(g).reshape(-1)
        m = np.asarray(m).reshape(-1)
        if g.size != m.size:
            raise ValueError(f"size mismatch: {g.size} vs {m.size}")
        for start in range(0, g.size, BLOCK):
            stop = start + BLOCK
            self._add(g[start:stop], m[start:stop])
        return self

    def _add(self, g_in: np.ndarray, m_in: np.ndarray) -> None:
        if not g_in.size:
            return
        # max and min of the block as given (the float64 copy holds the same values in twice
        # the bytes); NaN propagates through both and Inf shows in one, so four finite values
        # prove the block finite. They are reused as the log-sum-exp peaks.
        ranges = [(float(x.max()), float(x.min())) for x in (g_in, m_in)]
        g, m = g_in.astype(np.float64), m_in.astype(np.float64)
        if all(math.isfinite(v) for r in ranges for v in r):
            for side, x, (hi, lo) in ((self.golden, g, ranges[0]), (self.mine, m, ranges[1])):
                side.count += x.size
                side.total += total(x)
                side.max, side.min = max(side.max, hi), min(side.min, lo)
            self._errors(g, m, *ranges, precision=np.result_type(g_in, m_in, np.float32))
            return
        fg, fm = np.isfinite(g), np.isfinite(m)
        both = fg & fm
        self.golden.add(g[fg])
        self.mine.add(m[fm])
        self.golden.nonfinite += int(g.size - fg.sum())
        self.mine.nonfinite += int(m.size - fm.sum())
        self.nan_inf.golden = self.golden.nonfinite
        self.nan_inf.mine = self.mine.nonfinite
        bad = ~both
        gb, mb = g[bad], m[bad]
        same = (np.isnan(gb) & np.isnan(mb)) | (np.isinf(gb) & (gb == mb))
        self.nan_inf.mismatched += int(bad.sum() - same.sum())
        if self.rules == "msprobe":  # msprobe sets equal NaN/Inf to 0 on both sides
            matched = int(same.sum())
            self.n_ratio += matched
            self.within_1e3 += matched
            self.within_5e3 += matched
        g, m = g[both], m[both]
        if g.size:
            self._errors(g, m, precision=np.result_type(g_in, m_in, np.float32))

    def _errors(self, g: np.ndarray, m: np.ndarray, g_range=(None, None), m_range=(None, None),
                precision=np.float32):
        """Every pair metric of a float64 block finite on both sides. ``g`` and ``m`` are the
        caller's scratch copies: they are overwritten in turn by m - g and |g|, so the block
        stays in two buffers (the CPU's L2 holds two records, not the five of fresh arrays)."""
        self.n += g.size
        self.n_ratio += g.size
        if self.rules == "msprobe":
            self._msprobe_relative(g, m, precision)
        self.gg += dot(g, g)
        self.mm += dot(m, m)
        self.gm += dot(g, m)
        self._lse_m.add(m, None, *m_range)
        d = np.subtract(m, g, out=m)
        self.dd += dot(d, d)
        self._lse_g.add(g, d, *g_range)
        ad = np.abs(d, out=d)
        ag = np.abs(g, out=g)
        self.abs_max = max(self.abs_max, float(ad.max()))
        self.abs_sum += total(ad)
        # |g| > eps everywhere (so g != 0 too), the common case: q is the relative error
        all_big = float(ag.min()) > FP32_EPS
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            # |m/g - 1| = |m - g| / |g|; a masked divide (where=) is 20x slower. When |g| is
            # not needed any more (all_big), the quotient overwrites it.
            q = np.divide(ad, ag, out=ag) if all_big else ad / ag
        rel = q if all_big else np.where(ag > FP32_EPS, q, 0.0)
        self.rel_sum += total(rel)
        if self.rules == "msprobe":
            return
        self.rel_max = max(self.rel_max, float(rel.max()))
        # where g == 0, eps is added to both sides, so the error is |m| / eps
        zero = None if all_big else ag == 0
        ratio = ad / np.where(zero, FP32_EPS, ag) if zero is not None and zero.any() else q
        self.within_1e3 += int(np.count_nonzero(ratio <= 1e-3))
        self.within_5e3 += int(np.count_nonzero(ratio <= 5e-3))

    def _msprobe_relative(self, g: np.ndarray, m: np.ndarray, precision) -> None:
        """msprobe's get_relative_err and calc_relative_err_ratio on one block (before ``g``
        and ``m`` are overwritten): |(m - g) / g| in the inputs' precision, eps of that
        precision added to both where g == 0, ratios with a strict <."""
        b = g.astype(precision)
        n = m.astype(precision)
        zero = b == 0
        if zero.any():
            eps = np.finfo(precision).eps
            b[zero] += eps
            n[zero] += eps
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            rel = np.abs(np.divide(n - b, b))
        self.rel_max = max(self.rel_max, float(rel.max()))
        self.within_1e3 += int(np.count_nonzero(rel < 1e-3))
        self.within_5e3 += int(np.count_nonzero(rel < 5e-3))

    # -- results -------------------------------------------------------------------------
    @property
    def cosine_similarity(self) -> float:
        if self.gg == 0 and self.mm == 0:
            return 1.0 if self.n else math.nan
        if self.gg == 0 or self.mm == 0:
            return math.nan
        return self.gm / math.sqrt(self.gg * self.mm)

    @property
    def max_relative_error(self) -> float:
        if self.rules == "msprobe" and self.nan_inf.mismatched:
            return math.nan  # msprobe: N/A
        return self.rel_max if self.n else math.nan

    @property
    def mean_relative_error(self) -> float:
        return self.rel_sum / self.n if self.n else math.nan

    @property
    def max_absolute_error(self) -> float:
        return self.abs_max if self.n else math.nan

    @property
    def mean_absolute_error(self) -> float:
        return self.abs_sum / self.n if self.n else math.nan

    @property
    def kl_divergence(self) -> float:
        """sum p_g (log p_g - log p_m) = E_pg[g - m] - LSE(g) + LSE(m), clamped at 0."""
        if not self.n:
            return math.nan
        lse_g, lse_m = self._lse_g, self._lse_m
        mean_diff = -lse_g.weighted / lse_g.total  # E_pg[g - m]; weights were d = m - g
        kl = mean_diff + (lse_m.peak - lse_g.peak) + math.log(lse_m.total / lse_g.total)
        return max(kl, 0.0)

    @property
    def relative_euclidean_distance(self) -> float:
        if not self.n:
            return math.nan
        if math.sqrt(self.gg) <= FP32_EPS:
            return 0.0
        return math.sqrt(self.dd / self.gg)

    @property
    def sqnr(self) -> float:
        if not self.n:
            return math.nan
        if self.dd == 0:
            return math.inf
        if self.gg == 0:
            return -math.inf
        return 10.0 * math.log10(self.gg / self.dd)

    @property
    def euclidean_distance(self) -> float:
        """sqrt(sum (m - g)^2): msprobe's EucDist (absolute)."""
        return math.sqrt(self.dd) if self.n else math.nan

    @property
    def one_thousandth_err_ratio(self) -> float:
        return self._ratio(self.within_1e3)

    @property
    def five_thousandths_err_ratio(self) -> float:
        return self._ratio(self.within_5e3)

    def _ratio(self, count: int) -> float:
        if self.rules == "msprobe" and self.nan_inf.mismatched:
            return math.nan  # msprobe: N/A
        return count / self.n_ratio if self.n_ratio else math.nan

    @property
    def golden_all_zero(self) -> bool:
        return self.n > 0 and self.gg == 0

    @property
    def mine_all_zero(self) -> bool:
        return self.n > 0 and self.mm == 0

    def metrics(self) -> dict[str, float]:
        """Every metric by its report column name."""
        return {name: getattr(self, name) for name in METRIC_NAMES}


METRIC_NAMES = (
    "cosine_similarity", "max_relative_error", "mean_relative_error", "max_absolute_error",
    "mean_absolute_error", "kl_divergence", "relative_euclidean_distance", "sqnr",
    "euclidean_distance", "one_thousandth_err_ratio", "five_thousandths_err_ratio",
)


def compare_arrays(golden: np.ndarray, mine: np.ndarray, rules: str = "msit") -> PairStats:
    """All metrics of two whole arrays with the same number of elements."""
    return PairStats(rules=rules).add(golden, mine)


def cosine_similarity(golden: np.ndarray, mine: np.ndarray) -> float:
    return compare_arrays(golden, mine).cosine_similarity


def max_relative_error(golden: np.ndarray, mine: np.ndarray) -> float:
    return compare_arrays(golden, mine).max_relative_error


def mean_relative_error(golden: np.ndarray, mine: np.ndarray) -> float:
    return compare_arrays(golden, mine).mean_relative_error


def max_absolute_error(golden: np.ndarray, mine: np.ndarray) -> float:
    return compare_arrays(golden, mine).max_absolute_error


def mean_absolute_error(golden: np.ndarray, mine: np.ndarray) -> float:
    return compare_arrays(golden, mine).mean_absolute_error


def kl_divergence(golden: np.ndarray, mine: np.ndarray) -> float:
    return compare_arrays(golden, mine).kl_divergence


def relative_euclidean_distance(golden: np.ndarray, mine: np.ndarray) -> float:
    return compare_arrays(golden, mine).relative_euclidean_distance


def sqnr(golden: np.ndarray, mine: np.ndarray) -> float:
    return compare_arrays(golden, mine).sqnr


def one_thousandth_err_ratio(golden: np.ndarray, mine: np.ndarray) -> float:
    return compare_arrays(golden, mine).one_thousandth_err_ratio


def five_thousandths_err_ratio(golden: np.ndarray, mine: np.ndarray) -> float:
    return compare_arrays(golden, mine).five_thousandths_err_ratio


def nan_inf(golden: np.ndarray, mine: np.ndarray) -> NanInf:
    return compare_arrays(golden, mine).nan_inf
