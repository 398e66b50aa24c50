"""Verdict of one compared layer against a baseline: PASS / WARN / FAIL, with dtype-aware limits.

The main criterion is the relative error ``relative_euclidean_distance`` (RED = |m - g| / |g|
over the whole tensor). Its limits depend on the less precise of the two dtypes (the
*tolerance* dtype), because a bf16 run differs from an fp32 run by bf16 rounding however
correct it is:

==========  ===========  ===========  ============================================
tolerance   PASS if RED  FAIL if RED  unit roundoff u (floor of error_amplification)
==========  ===========  ===========  ============================================
float64     <= 1e-4      > 1e-3       2^-53
float32     <= 1e-4      > 1e-3       2^-24
float16     <= 2e-3      > 2e-2       2^-11
bfloat16    <= 1.5e-2    > 1.5e-1     2^-8
==========  ===========  ===========  ============================================

plus, for every dtype: FAIL when cosine < 0.99 (msprobe's acceptance line), FAIL on NaN/Inf
that the baseline does not have at the same positions, FAIL when exactly one side is all zero.
Optional limits (off by default): cosine below ``cos_warn`` -> WARN; max absolute error above
``max_abs_warn`` / ``max_abs_fail`` -> WARN / FAIL (msprobe's 0.001 is absolute, so it only
makes sense for values of known scale). The FAIL limit is 10x the PASS limit, so a layer whose
input PASSes and whose output FAILs multiplied the error by more than 10: an accumulation of
rounding errors, which grows slowly, cannot do that. Rationale: docs/method.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Callable

from ..errors import UserError
from .metrics import METRIC_RULES, PairStats
from .verdicts import FAIL, NOT_COMPARED, PASS, VERDICT_RANK, VERDICTS, WARN

__all__ = ["FAIL", "NOT_COMPARED", "PASS", "VERDICT_RANK", "VERDICTS", "WARN", "Thresholds"]

AUTO = "auto"
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
TOLERANCES = tuple(UNIT_ROUNDOFF)
MSPROBE_COSINE = 0.99


@dataclass(frozen=True)
class Limits:
    """Concrete limits for one tolerance dtype; None switches a criterion off."""

    tolerance: str
    rel_dist_warn: float
    rel_dist_fail: float
    cos_warn: float | None = None
    cos_fail: float | None = MSPROBE_COSINE
    max_abs_warn: float | None = None
    max_abs_fail: float | None = None

    @property
    def floor(self) -> float:
        """Errors below one unit roundoff of the tolerance dtype count as one unit."""
        return UNIT_ROUNDOFF[self.tolerance]


DEFAULT_LIMITS = {
    "float64": Limits("float64", 1e-4, 1e-3),
    "float32": Limits("float32", 1e-4, 1e-3),
    "float16": Limits("float16", 2e-3, 2e-2),
    "bfloat16": Limits("bfloat16", 1.5e-2, 1.5e-1),
}


class InvalidThresholds(UserError):
    """Limits that cannot be used. ``str()`` names the Thresholds fields; ``render`` lets a
    front end name its own options instead (e.g. ``--rel-dist-warn``)."""

    def __init__(self, template: str, *fields: str):
        self.template, self.fields = template, fields
        super().__init__(self.render(lambda name: name))

    def render(self, option: Callable[[str], str]) -> str:
        return self.template.format(*(option(f) for f in self.fields))


@dataclass(frozen=True)
class Thresholds:
    """User overrides of the defaults; None keeps the tolerance dtype's default.

    ``tolerance`` = "auto" (the less precise dtype of the two sides) or a dtype name whose
    defaults are used for every row, e.g. "float16" for fp32 runs with TF32/HF32 matmuls.
    """

    tolerance: str = AUTO
    rel_dist_warn: float | None = None
    rel_dist_fail: float | None = None
    cos_warn: float | None = None
    cos_fail: float | None = None
    max_abs_warn: float | None = None
    max_abs_fail: float | None = None
    metrics: str = "msit"  # metric rules of max_relative_error and the thousandth ratios

    def validate(self) -> Thresholds:
        """Self, or InvalidThresholds naming the fields that cannot be used together."""
        if self.metrics not in METRIC_RULES:
            raise InvalidThresholds(
                f"{{0}} {self.metrics!r}: use one of {', '.join(METRIC_RULES)}", "metrics")
        if self.tolerance != AUTO and self.tolerance not in TOLERANCES:
            raise InvalidThresholds(
                f"{{0}} {self.tolerance!r}: use auto or one of {', '.join(TOLERANCES)}",
                "tolerance")
        for name in ("cos_warn", "cos_fail"):
            value = getattr(self, name)
            if value is not None and not -1.0 <= value <= 1.0:
                raise InvalidThresholds(f"{{0}} {value}: a cosine limit is between -1 and 1", name)
        for name in ("rel_dist_warn", "rel_dist_fail", "max_abs_warn", "max_abs_fail"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise InvalidThresholds(f"{{0}} {value}: must be a finite number >= 0", name)
        for kind in ("rel_dist", "max_abs"):
            warn, fail = getattr(self, f"{kind}_warn"), getattr(self, f"{kind}_fail")
            if warn is not None and fail is not None and warn > fail:
                raise InvalidThresholds(f"{{0}} {warn} is above {{1}} {fail}",
                                        f"{kind}_warn", f"{kind}_fail")
        cos_warn, cos_fail = self.cos_warn, self.cos_fail
        if cos_warn is not None and cos_fail is not None and cos_warn < cos_fail:
            raise InvalidThresholds(f"{{0}} {cos_warn} is below {{1}} {cos_fail}",
                                    "cos_warn", "cos_fail")
        return self

    def limits(self, golden_dtype: str, my_dtype: str) -> Limits:
        """Limits for a row comparing these two dtypes, overrides applied."""
        tolerance = (
            tolerance_dtype(golden_dtype, my_dtype) if self.tolerance == AUTO else self.tolerance
        )
        base = DEFAULT_LIMITS[tolerance]
        overrides = {k: v for k, v in asdict(self).items()
                     if k not in ("tolerance", "metrics") and v is not None}
        limits = replace(base, **overrides)
        # An override of one side of a pair must not leave the other one inconsistent.
        if limits.rel_dist_warn > limits.rel_dist_fail:
            if self.rel_dist_warn is not None:
                limits = replace(limits, rel_dist_fail=limits.rel_dist_warn)
            else:
                limits = replace(limits, rel_dist_warn=limits.rel_dist_fail)
        return limits


def tolerance_dtype(golden_dtype: str, my_dtype: str) -> str:
    """The less precise of two logical dtypes (unknown names count as float32)."""
    known = [d if d in UNIT_ROUNDOFF else "float32" for d in (golden_dtype, my_dtype)]
    return max(known, key=lambda d: UNIT_ROUNDOFF[d])


def judge(stats: PairStats, limits: Limits) -> tuple[str, list[str]]:
    """(verdict, reasons) of one compared tensor pair; the reasons say why it is not PASS."""
    reasons: list[str] = []
    fail = warn = False
    nan_inf = stats.nan_inf
    if nan_inf.any:
        reasons.append(nan_inf.describe())
        if nan_inf.mismatched:
            fail = True
        else:
            warn = True
    if stats.n == 0:
        return (FAIL if fail else WARN), reasons + ["no finite values to compare"]
    if stats.golden_all_zero != stats.mine_all_zero:
        side = "golden" if stats.golden_all_zero else "my"
        return FAIL, reasons + [f"{side} data is all zero, the other is not"]
    red, cos, max_abs = (
        stats.relative_euclidean_distance, stats.cosine_similarity, stats.max_absolute_error
    )
    if red > limits.rel_dist_fail:
        fail = True
    elif red > limits.rel_dist_warn:
        warn = True
    if limits.cos_fail is not None and cos < limits.cos_fail:
        fail = True
    elif limits.cos_warn is not None and cos < limits.cos_warn:
        warn = True
    if limits.max_abs_fail is not None and max_abs > limits.max_abs_fail:
        fail = True
    elif limits.max_abs_warn is not None and max_abs > limits.max_abs_warn:
        warn = True
    return (FAIL if fail else WARN if warn else PASS), reasons
