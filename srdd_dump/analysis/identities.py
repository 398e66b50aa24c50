"""Exact identities and the host reference, judged: pure numpy (docs/method.md).

* ``scale_check``: a linear operator's y(2^k x) * 2^-k against y(x) from a call of the same
  shape. Healthy: equal bit for bit wherever neither value is near the dtype's overflow or
  underflow. The broken elements' pattern names the cause.
* ``causal_check``: rows before the cut of a causality probe against the reference rows.
  Healthy: equal bit for bit.
* ``relative_distance``: the device rows against their float64 host replay (the baseline
  mode's relative Euclidean distance, judged with its dtype-aware limits).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..vocabulary import CHANNEL_FLOOR
from .array_stats import median
from .metrics import BLOCK, compare_arrays
from .sums import dot

# finfo of each logical dtype: the normal range an element must stay in, with margin
_RANGE = {
    "float64": (np.finfo(np.float64).tiny, np.finfo(np.float64).max),
    "float32": (np.finfo(np.float32).tiny, np.finfo(np.float32).max),
    "bfloat16": (np.finfo(np.float32).tiny, 3.38e38),
    "float16": (np.finfo(np.float16).tiny, np.finfo(np.float16).max),
}
ZERO, CLIP, OFFSET, OTHER = "zero", "clip", "offset", "other"


class ScaleCheck(NamedTuple):
    broken: int  # elements where the identity fails
    judged: int  # elements inside the dtype's safe range
    pattern: str  # ZERO, CLIP, OFFSET or OTHER ("" when nothing is broken)
    size: float = 0.0  # rms of the differences / rms of the reference, judged elements


def scale_check(ref: np.ndarray, scaled: np.ndarray, k: int, dtype: str) -> ScaleCheck:
    """``ref`` = y(x), ``scaled`` = y(2^k x) * 2^-k, both (rows, width) of one dtype."""
    ref = ref.reshape(-1, ref.shape[-1])
    scaled = scaled.reshape(-1, scaled.shape[-1])
    if ref.shape != scaled.shape or not ref.size:
        return ScaleCheck(0, 0, "")
    tiny, big = _RANGE.get(dtype, _RANGE["float32"])
    margin = 2.0 ** (abs(k) + 1)
    size = np.maximum(np.abs(ref), np.abs(scaled))
    with np.errstate(invalid="ignore", over="ignore"):
        judged = (np.isfinite(ref) & np.isfinite(scaled) & (size >= tiny * margin)
                  & (size <= big / margin))
    broken = judged & (ref != scaled)
    n_broken = int(np.count_nonzero(broken))
    if not n_broken:
        return ScaleCheck(0, int(np.count_nonzero(judged)), "")
    return ScaleCheck(n_broken, int(np.count_nonzero(judged)),
                      scale_pattern(ref, scaled, broken),
                      relative_distance(scaled[judged], ref[judged]))


def zero_check(out: np.ndarray, clean: np.ndarray) -> ScaleCheck:
    """A bias-free module's output for zero input rows (``out``), which must be exactly 0:
    the broken elements, their pattern (OFFSET: a constant per broken channel, a bias; else
    OTHER), and their rms relative to the rms of the module's output ``clean``."""
    out = out.reshape(-1, out.shape[-1]).astype(np.float64)
    broken = out != 0
    n_broken = int(np.count_nonzero(broken))
    if not n_broken:
        return ScaleCheck(0, out.size, "")
    scale = float(np.sqrt(np.mean(np.square(clean.astype(np.float64))))) if clean.size else 0.0
    size = float(np.sqrt(np.mean(np.square(np.where(np.isfinite(out), out, 0.0)))))
    return ScaleCheck(n_broken, out.size, zero_pattern(out, broken),
                      size / scale if scale > 0 else math.inf)


def zero_pattern(out: np.ndarray, broken: np.ndarray) -> str:
    """OFFSET when most broken channels hold one value on every row, else OTHER ("" for one
    row: no pattern to see)."""
    columns = np.flatnonzero(broken.any(axis=0))
    if out.shape[0] < 2 or not columns.size:
        return ""
    part = out[:, columns]
    constant = np.all(part == part[:1], axis=0)
    return OFFSET if np.count_nonzero(constant) >= 0.5 * columns.size else OTHER


def scale_pattern(ref: np.ndarray, scaled: np.ndarray, broken: np.ndarray) -> str:
    """What the broken elements look like:

    * ZERO: one side is exactly 0 on most of them (values below a limit flushed to zero);
    * CLIP: one side sits at one magnitude shared by many of them (a clamp at a fixed limit);
    * OFFSET: most judged elements are broken and each channel moved by about the same amount
      (a fixed offset c moves y(2^k x) * 2^-k by c (2^-k - 1));
    * OTHER: a quantiser with a fixed scale, a rounding step, noise.
    """
    a, b = ref[broken].astype(np.float64), scaled[broken].astype(np.float64)
    if np.count_nonzero((a == 0) | (b == 0)) >= 0.5 * a.size:
        return ZERO
    mags = np.concatenate([np.abs(a), np.abs(b)])
    _, counts = np.unique(mags, return_counts=True)
    if a.size >= 4 and counts.max() >= 0.25 * a.size:
        return CLIP
    if np.count_nonzero(broken) >= 0.5 * broken.size:
        diff = (scaled.astype(np.float64) - ref.astype(np.float64))
        mean_c = np.abs(diff.mean(axis=0))
        spread_c = diff.std(axis=0)
        if np.median(mean_c / np.maximum(spread_c, 1e-30)) > 3.0:
            return OFFSET
    return OTHER


def causal_check(ref: np.ndarray, out: np.ndarray, positions: np.ndarray, cut: int
                 ) -> tuple[int, int, float]:
    """(elements that moved, elements judged, rms of the moves / rms of the reference) in the
    rows before ``cut``; ``positions``: the token position of each row of ``ref``/``out``
    (rows, width)."""
    ref = ref.reshape(-1, ref.shape[-1])
    out = out.reshape(-1, out.shape[-1])
    if ref.shape != out.shape or positions.size != ref.shape[0]:
        return 0, 0, 0.0
    before = positions < cut
    a, b = ref[before], out[before]
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    moved = int(same.size - np.count_nonzero(same))
    return moved, int(same.size), relative_distance(b, a) if moved else 0.0


def relative_distance(device: np.ndarray, host: np.ndarray) -> float:
    """||device - host|| / ||host|| (the baseline mode's RED, ``metrics.PairStats``) over the
    elements finite on both sides; inf when NaN/Inf positions differ or only the host is all
    zero."""
    if device.size != host.size or not device.size:
        return float("nan")
    g, m = host.reshape(-1), device.reshape(-1)
    if all(math.isfinite(v) for x in (g, m) for v in (float(x.max()), float(x.min()))):
        # every element finite: compare_arrays's sums only, block by block as it adds them
        gg = dd = 0.0
        for start in range(0, g.size, BLOCK):
            gb = g[start: start + BLOCK].astype(np.float64)
            d = np.subtract(m[start: start + BLOCK].astype(np.float64), gb)
            gg += dot(gb, gb)
            dd += dot(d, d)
        if gg == 0:
            return 0.0 if dd == 0 else float("inf")
        return math.sqrt(dd / gg)
    stats = compare_arrays(host, device)
    if stats.nan_inf.mismatched:
        return float("inf")
    if stats.gg == 0:
        return 0.0 if stats.dd == 0 else float("inf")
    return math.sqrt(stats.dd / stats.gg)




# unit roundoff of each logical dtype: a computed exact 0 whose true value is within a few of
# these of the row's largest magnitude is rounding (1 + tanh(u) rounding to 0), not a flush
_EPS = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11,
        "bfloat16": 2.0 ** -8}


def zeros_explained(device: np.ndarray, host: np.ndarray, dtype: str) -> float:
    """The share of the device's exact zeros where the host value is 0 too, to 4 units of the
    dtype's roundoff of its row's largest magnitude (NaN when the device has no zeros)."""
    d = device.reshape(-1, device.shape[-1])
    h = host.reshape(-1, host.shape[-1]).astype(np.float64)
    if d.shape != h.shape:
        return float("nan")
    zeros = d == 0
    n = int(np.count_nonzero(zeros))
    if not n:
        return float("nan")
    scale = np.max(np.abs(np.where(np.isfinite(h), h, 0.0)), axis=-1, keepdims=True)
    small = np.abs(h) <= 4 * _EPS.get(dtype, _EPS["float32"]) * scale
    return float(np.count_nonzero(zeros & small)) / n


def channel_distance(device: np.ndarray, host: np.ndarray) -> float:
    """The largest relative distance of one channel (column) of the rows, over the channels
    whose rms is at least CHANNEL_FLOOR x the median channel rms (a channel of values near 0
    has a large relative error from rounding alone). A fault in a few channels (precision
    lost on 10% of them) hides in the whole tensor's distance; NaN when under 8 rows."""
    d = device.reshape(-1, device.shape[-1]).astype(np.float64)
    h = host.reshape(-1, host.shape[-1]).astype(np.float64)
    if d.shape != h.shape or d.shape[0] < 8:
        return float("nan")
    ok = np.isfinite(h).all(axis=0) & np.isfinite(d).all(axis=0)
    if not ok.any():
        return float("nan")
    d, h = d[:, ok], h[:, ok]  # (a copy whose layout sets the summation order below)
    norm = np.sqrt((h * h).mean(axis=0))
    live = norm >= CHANNEL_FLOOR * median(norm)
    if not live.any():
        return float("nan")
    err = np.sqrt(((d - h) ** 2).mean(axis=0))
    return float((err[live] / norm[live]).max())
