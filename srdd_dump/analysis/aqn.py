"""SRDD-guided AQN: training-noise scales per layer from the diagnosis signals (seed 001's
rules). Arrays in, a dict out; ``report.aqn`` writes the YAML.

For each layer, starting from ``base`` (0.05):

* x1.5 when its gain is below 0.8 x the median gain (signal loss risk);
* x1.5 when its kurtosis is above 1.2 x the median kurtosis (saturation risk);
* x0.5 when its instability (rms of repeat differences / rms of the output) is above 0.1
  (the layer is already noisy);
* clipped to [0.01, 0.15]. High-priority layers: sigma > 1.2 x base.

With several dump files the per-layer signals are medians over the files.
"""

from __future__ import annotations

import math

import numpy as np

BASE_SIGMA = 0.05
LOW_GAIN = 0.8
HIGH_KURTOSIS = 1.2
NOISY = 0.1
SIGMA_RANGE = (0.01, 0.15)
HIGH_PRIORITY = 1.2


def layer_sigmas(layers: list[int], gain: np.ndarray, kurtosis: np.ndarray,
                 instability: np.ndarray, base: float = BASE_SIGMA) -> dict[int, float]:
    """Training-noise sigma per layer from its gain, kurtosis and instability (one value per
    layer, in the order of ``layers``)."""
    med_gain = _median(gain)
    med_kurt = _median(kurtosis)
    sigmas = {}
    for layer, g, k, inst in zip(layers, gain, kurtosis, instability):
        sigma = base
        if _finite(g) and _finite(med_gain) and g < LOW_GAIN * med_gain:
            sigma *= 1.5
        if k > HIGH_KURTOSIS * med_kurt:
            sigma *= 1.5
        if _finite(inst) and inst > NOISY:
            sigma *= 0.5
        sigmas[int(layer)] = round(min(max(sigma, SIGMA_RANGE[0]), SIGMA_RANGE[1]), 6)
    return sigmas


def _median(values: np.ndarray) -> float:
    """pandas' median: NaN left out, NaN when nothing is left."""
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    return float(np.median(v)) if v.size else float("nan")


def _finite(x) -> bool:
    return isinstance(x, (int, float, np.floating)) and math.isfinite(x)
