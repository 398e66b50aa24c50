"""Multi-card consistency without a reference: each source against the median of the others.

For N >= 3 sources (devices, ranks, hosts) that ran the same model on the same inputs, each
layer's tensors are compared element by element: source i against ``med_i``, the element-wise
median of the other N-1 sources (NaN/Inf left out of the median). Per (layer, source), pooled
over every common round:

* ``cosine_similarity`` of x_i and med_i, ``max_absolute_error`` max |x_i - med_i|,
* ``relative_error`` = sqrt(sum (x_i - med_i)^2 / sum med_i^2),
* ``others_relative_error``: the median over j != i of the same quantity for x_j against
  med_i: how far the other sources are from their own median (their spread),
* ``nan_inf``: elements non-finite in x_i where med_i is finite.

Source i *departs* at a layer when it has such NaN/Inf, or when its relative error is above the
tolerance (the PASS limit of the baseline mode for the dtype) and at least ``DEPART_FACTOR``
times the others' spread (floored at one unit roundoff). With three sources and one faulty, the
two healthy ones are each half a fault away from their median, but so is the other healthy one
(spread ratio ~1), while the faulty one is a whole fault away from two sources that agree
(spread ratio >> 1): only the faulty one departs.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from .sums import dot

DEPART_FACTOR = 10.0


class LayerConsistency:
    """Streaming accumulator for one layer of N sources; ``add`` one block per source."""

    def __init__(self, n_sources: int):
        if n_sources < 3:
            raise ValueError("consistency needs at least 3 sources")
        n = n_sources
        self.n = n
        self.xx = np.zeros(n)
        self.mm = np.zeros(n)
        self.xm = np.zeros(n)
        self.dd = np.zeros(n)
        self.max_abs = np.zeros(n)
        self.nan_inf = np.zeros(n, dtype=np.int64)
        self.others_dd = np.zeros((n, n))  # [i, j]: sum (x_j - med_i)^2
        self.others_mm = np.zeros((n, n))  # [i, j]: sum med_i^2 where x_j is finite
        self.rounds = 0

    def add(self, blocks: list[np.ndarray]) -> None:
        """One block per source, all the same shape (the same rows of the same round)."""
        x = np.stack([np.asarray(b, dtype=np.float64).reshape(-1) for b in blocks])
        finite = np.isfinite(x)
        if not finite.all():
            x = np.where(finite, x, np.nan)
        all_finite = bool(finite.all())
        for i in range(self.n):
            med = _median(np.delete(x, i, axis=0), all_finite)
            if all_finite:
                self._add_finite(i, x, med)
                continue
            ok_med = np.isfinite(med)
            self.nan_inf[i] += int(np.count_nonzero(~finite[i] & ok_med))
            for j in range(self.n):
                valid = finite[j] & ok_med
                d = x[j, valid] - med[valid]
                ref = med[valid]
                if j == i:
                    xi = x[i, valid]
                    self.xx[i] += dot(xi, xi)
                    self.mm[i] += dot(ref, ref)
                    self.xm[i] += dot(xi, ref)
                    self.dd[i] += dot(d, d)
                    if d.size:
                        self.max_abs[i] = max(self.max_abs[i], float(np.abs(d).max()))
                else:
                    self.others_dd[i, j] += dot(d, d)
                    self.others_mm[i, j] += dot(ref, ref)

    def _add_finite(self, i: int, x: np.ndarray, med: np.ndarray) -> None:
        diff = x - med
        dd = np.einsum("jk,jk->j", diff, diff)
        mm = dot(med, med)
        self.xx[i] += dot(x[i], x[i])
        self.mm[i] += mm
        self.xm[i] += dot(x[i], med)
        self.dd[i] += float(dd[i])
        if diff.shape[1]:
            self.max_abs[i] = max(self.max_abs[i], float(np.abs(diff[i]).max()))
        others = np.arange(self.n) != i
        self.others_dd[i, others] += dd[others]
        self.others_mm[i, others] += mm

    def results(self, tolerance: float, floor: float) -> list[dict]:
        """Per source: the metrics of the module docstring and ``departs``."""
        out = []
        for i in range(self.n):
            cos = (
                self.xm[i] / math.sqrt(self.xx[i] * self.mm[i])
                if self.xx[i] > 0 and self.mm[i] > 0
                else (1.0 if self.xx[i] == self.mm[i] == 0 else math.nan)
            )
            rel = _rel(self.dd[i], self.mm[i])
            spread = [_rel(self.others_dd[i, j], self.others_mm[i, j])
                      for j in range(self.n) if j != i]
            others = float(np.median(spread))
            departs = bool(self.nan_inf[i]) or (
                rel > tolerance and rel >= DEPART_FACTOR * max(others, floor)
            )
            out.append({
                "cosine_similarity": float(cos), "max_absolute_error": float(self.max_abs[i]),
                "relative_error": rel, "others_relative_error": others,
                "nan_inf": int(self.nan_inf[i]), "departs": departs,
            })
        return out


def _median(others: np.ndarray, all_finite: bool) -> np.ndarray:
    if all_finite:
        return np.median(others, axis=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns give NaN, on purpose
        return np.nanmedian(others, axis=0)


def _rel(dd: float, mm: float) -> float:
    if mm > 0:
        return math.sqrt(dd / mm)
    return 0.0 if dd == 0 else math.inf
