"""Rows of a stats dump's /stats table (``--store stats``) as ``analysis.signals.RoundStats``:
the same per-round reductions the compare computes from tensors, read instead of computed."""

from __future__ import annotations

import math

import numpy as np

from ..analysis.moments import Moments
from ..analysis.signals import RoundStats
from ..format import schema as s


class StatsLayout:
    """Where each reduction sits among a file's columns."""

    def __init__(self, columns: list[str]):
        at = {name: i for i, name in enumerate(columns)}
        self.fixed = {name: at.get(name) for name in (
            *s.MOMENT_COLUMNS, *s.SHAPE_COLUMNS, *s.BATCH_COLUMNS, *s.DIFF_COLUMNS,
            *s.SCALE_COLUMNS, *s.CAUSAL_COLUMNS, *s.HOST_COLUMNS)}
        self.gains: list[tuple[float, int]] = []  # (sigma, column)
        dc: dict[float, dict[str, int]] = {}
        repeats: dict[float, dict[str, int]] = {}
        for name, i in at.items():
            parsed = s.parse_probe_column(name)
            if parsed is None:
                continue
            kind, number, part = parsed
            if kind == "gain":
                self.gains.append((number, i))
            elif kind == "dc":
                dc.setdefault(number, {})[part] = i
            else:
                repeats.setdefault(number, {})[part] = i
        self.dc = [dc[v] for v in sorted(dc)]
        self.repeats = [repeats[r] for r in sorted(repeats)]

    def round_stats(self, row: np.ndarray, sample: int, dtype: str) -> RoundStats:
        def get(name: str) -> float:
            i = self.fixed.get(name)
            return float(row[i]) if i is not None else math.nan

        def count(name: str) -> int:
            v = get(name)
            return int(v) if math.isfinite(v) else 0

        # a file without the higher moments or the zero count (converted from msprobe
        # statistics) leaves them unknown: NaN, so the kurtosis is not taken for that of a
        # normal distribution, nor the zero fraction for 0
        m3, m4 = (_zero(get(k)) if self.fixed[k] is not None else math.nan for k in ("m3", "m4"))
        zeros = count("zeros") if self.fixed["zeros"] is not None else math.nan
        moments = Moments(count=count("n"), mean_=_zero(get("mean")), m2=_zero(get("m2")),
                          m3=m3, m4=m4, absmax=_zero(get("absmax")),
                          zeros=zeros, nan_count=count("nan"),
                          inf_count=count("inf"))
        out = RoundStats(sample=sample, dtype=dtype, moments=moments,
                         **{name: get(name) for name in s.SHAPE_COLUMNS})
        batch = tuple(get(name) for name in s.BATCH_COLUMNS)
        if any(math.isfinite(v) for v in batch):
            out.batch_dep = batch
        out.gains = [(sigma, float(row[i])) for sigma, i in self.gains if math.isfinite(row[i])]
        for parts in self.dc:
            values = [float(row[parts[p]]) if p in parts else math.nan for p in s.DC_PARTS]
            if math.isfinite(values[3]):  # "probed": the dc probe was judged this round
                values[3] = int(values[3])
                out.dc.append(tuple(values))
        for parts in self.repeats:
            values = [float(row[parts[p]]) if p in parts else math.nan for p in s.REPEAT_PARTS]
            if any(math.isfinite(v) for v in values):
                out.repeats.append(tuple(values))
        if count("diff_n"):
            out.diffs = Moments(count=count("diff_n"), mean_=get("diff_mean"),
                                m2=get("diff_m2"), m3=get("diff_m3"), m4=get("diff_m4"))
        if count("scale_judged"):
            pattern = count("scale_pattern")
            out.scale = (get("scale_broken"), count("scale_judged"),
                         s.SCALE_PATTERNS[pattern] if pattern < len(s.SCALE_PATTERNS) else "",
                         get("scale_size"))
        if count("causal_judged"):
            out.causal.append((get("causal_broken"), count("causal_judged"),
                               get("causal_size")))
        host = (get("host_red"), get("host_channel_red"))
        if not all(math.isnan(v) for v in host):
            out.host = host
        return out


def _zero(value: float) -> float:
    return value if math.isfinite(value) else 0.0
