"""One-token records reduced together (analysis.row_stats) give round_stats's numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from srdd_dump.analysis.row_stats import one_row_stats
from srdd_dump.analysis.signals import round_stats


def _rows(width: int) -> np.ndarray:
    rng = np.random.default_rng(width)
    x = rng.standard_normal((9, width)).astype(np.float32)
    x[1] = 0.0  # all zeros: constant
    x[2] = 1.5  # constant, non-zero
    x[3, ::3] = 0.0  # many exact zeros
    x[4, 5] = np.nan
    x[5, 7] = np.inf
    # bf16 values (16 low bits zero, so the 13 of fp16 precision too): lowbits 1
    x[6] = (x[6].view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    # a dequantised 8-bit row: codes times a scale (on the grid)
    x[7] = (rng.integers(-127, 128, width) * np.float32(0.037)).astype(np.float32)
    x[8, : width // 2] = 1e4  # a pile-up at the top edge
    return x


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12,
                                                                 abs_tol=1e-300)
    return a == b


@pytest.mark.parametrize("width", [64, 576, 1536])
@pytest.mark.parametrize("with_before", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_row_stats_equal_round_stats(width, with_before, dtype):
    x = _rows(width)
    before = None
    if with_before:
        before = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
        before[2, 3] = np.nan  # a non-finite update on a finite row
    samples = list(range(len(x)))
    got = one_row_stats(x, dtype, samples, before)
    assert len(got) == len(x)
    for i, stats in enumerate(got):
        prev = None if before is None else before[i][None, None]
        want = round_stats(x[i][None, None], dtype, samples[i], prev)
        for name in ("sample", "dtype", "pileup", "ties", "tie_excess", "update_rms", "offset",
                     "dc_energy", "consistency", "stuck", "lowbits", "rows", "grid"):
            assert _same(getattr(stats, name), getattr(want, name)), (i, name)
        for name in ("count", "mean_", "m2", "m3", "m4", "absmax", "zeros", "nan_count",
                     "inf_count"):
            a, b = getattr(stats.moments, name), getattr(want.moments, name)
            assert _same(float(a), float(b)), (i, name, a, b)
        assert not stats.gains and not stats.dc and not stats.repeats


def test_rows_really_take_their_paths():
    """The crafted rows hit the cases they are named for (so the test above tests them)."""
    x = _rows(1536)
    stats = one_row_stats(x, "float32", list(range(len(x))))
    assert stats[1].moments.zeros == 1536 and stats[2].moments.m2 == 0.0
    assert stats[4].moments.nan_count == 1 and stats[5].moments.inf_count == 1
    assert stats[6].lowbits == 1.0
    assert stats[7].grid == 1.0 and stats[0].grid == 0.0
    assert stats[8].pileup > 10 and math.isnan(one_row_stats(x[:1, :64], "float32", [0])[0]
                                               .pileup)
