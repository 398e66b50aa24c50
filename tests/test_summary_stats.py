"""Whole-tensor statistics (analysis/summary_stats.py): what msprobe's statistics mode keeps,
and the relative error they prove."""

from __future__ import annotations

import math

import numpy as np
import pytest

from srdd_dump.analysis.metrics import SideStats
from srdd_dump.analysis.summary_stats import TensorSummary, from_side, from_stats, red_lower_bound

pytestmark = pytest.mark.unit


def summary(x: np.ndarray) -> TensorSummary:
    side = SideStats()
    for block in np.array_split(x.ravel(), 3):  # folded in blocks, as the compare reads
        side.add_raw(block)
    return from_side(side)


def red(m: np.ndarray, g: np.ndarray) -> float:
    return float(np.linalg.norm(m - g) / np.linalg.norm(g))


def test_the_statistics_of_blocks_are_those_of_the_whole_tensor():
    x = np.random.default_rng(0).standard_normal(1000) * 3 + 1
    s = summary(x)
    assert (s.n, s.max, s.min) == (1000, x.max(), x.min())
    assert s.mean == pytest.approx(x.mean()) and s.norm == pytest.approx(np.linalg.norm(x))
    nan = summary(np.array([1.0, np.nan, np.inf, 2.0]))
    assert nan.nonfinite == 2 and nan.n == 2 and nan.max == 2.0


@pytest.mark.parametrize("seed", range(20))
def test_the_bound_never_exceeds_the_relative_error(seed):
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(500) * rng.uniform(0.1, 10)
    kind = seed % 4
    m = (g + rng.standard_normal(500) * 0.1 if kind == 0 else g + 0.3 if kind == 1
         else np.clip(g, -1, 1) if kind == 2 else g * 1.05)
    bound = red_lower_bound(summary(m), summary(g))
    assert 0 <= bound <= red(m, g) + 1e-12


def test_the_bound_sees_offsets_clamps_and_scales_and_not_a_permutation():
    g = np.random.default_rng(1).standard_normal(4096)
    assert red_lower_bound(summary(g), summary(g)) == 0
    assert red_lower_bound(summary(g + 0.5), summary(g)) > 0.4  # offset: the mean shows it
    assert red_lower_bound(summary(np.clip(g, -1, 1)), summary(g)) > 0.05  # clamp: max, norm
    assert red_lower_bound(summary(g * 1.2), summary(g)) == pytest.approx(0.2)
    shuffled = np.random.default_rng(2).permutation(g)
    assert red_lower_bound(summary(shuffled), summary(g)) < 1e-12  # same statistics: unseen
    assert red(shuffled, g) > 1


def test_statistics_recorded_in_bf16_are_not_taken_for_an_error():
    g = np.random.default_rng(3).standard_normal(4096)
    # the norm cut to bf16's 8 significant bits, as msprobe computes it for a bf16 tensor
    bits = np.array([np.linalg.norm(g)], dtype=np.float32).view(np.uint32) & 0xFFFF0000
    norm_bf16 = float(bits.view(np.float32)[0])
    recorded = from_stats(g.size, g.max(), g.min(), g.mean(), norm_bf16, dtype="bfloat16")
    assert red_lower_bound(summary(g), recorded) == 0  # within the norm's bf16 rounding
    exact = from_stats(g.size, g.max(), g.min(), g.mean(), norm_bf16, dtype="float64")
    assert red_lower_bound(summary(g), exact) > 0


def test_the_norm_comes_from_the_moments_when_not_recorded():
    g = np.random.default_rng(4).standard_normal(100) + 2
    m2 = float(((g - g.mean()) ** 2).sum())
    s = from_stats(100, math.nan, math.nan, float(g.mean()), math.nan, m2=m2)
    assert s.norm == pytest.approx(np.linalg.norm(g))
    assert math.isnan(red_lower_bound(s, from_stats(100, 1, 0, 0.5, math.nan)))
