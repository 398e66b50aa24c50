"""``--aqn-config aqn.yaml``: SRDD-guided AQN training-noise scales per layer from a diagnosis
(seed 001's rules), written as YAML.

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
import os

import pandas as pd

from ..analysis.verdicts import FAULT
from ..errors import UserError

BASE_SIGMA = 0.05
LOW_GAIN = 0.8
HIGH_KURTOSIS = 1.2
NOISY = 0.1
SIGMA_RANGE = (0.01, 0.15)
HIGH_PRIORITY = 1.2


def layer_sigmas(layers: pd.DataFrame, base: float = BASE_SIGMA) -> dict[int, float]:
    per_layer = layers.groupby("layer")[["gain", "kurtosis", "instability"]].median()
    med_gain = per_layer["gain"].median()
    med_kurt = per_layer["kurtosis"].median()
    sigmas = {}
    for layer, row in per_layer.iterrows():
        sigma = base
        if _finite(row["gain"]) and _finite(med_gain) and row["gain"] < LOW_GAIN * med_gain:
            sigma *= 1.5
        if row["kurtosis"] > HIGH_KURTOSIS * med_kurt:
            sigma *= 1.5
        if _finite(row["instability"]) and row["instability"] > NOISY:
            sigma *= 0.5
        sigmas[int(layer)] = round(min(max(sigma, SIGMA_RANGE[0]), SIGMA_RANGE[1]), 6)
    return sigmas


def aqn_config(layers: pd.DataFrame, base: float = BASE_SIGMA) -> dict:
    sigmas = layer_sigmas(layers, base)
    return {
        "aqn": {
            "enabled": True,
            "layer_specific": True,
            "base_sigma": base,
            "layer_sigmas": sigmas,
            "schedule": "epoch_aware",
            "high_priority_layers": [k for k, v in sigmas.items() if v > base * HIGH_PRIORITY],
        },
        "srdd_metadata": {
            "num_layers": len(sigmas),
            "sources": sorted(set(layers["source"])),
            "fault_layers": sorted({int(x) for x in layers.loc[layers["verdict"] == FAULT,
                                                                "layer"]}),
        },
    }


def to_yaml(config: dict, indent: int = 0) -> str:
    """Minimal YAML for the nested dict/list/scalar config (no PyYAML dependency)."""
    pad = "  " * indent
    lines = []
    for key, value in config.items():
        if isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            lines.append(to_yaml(value, indent + 1))
        elif isinstance(value, list):
            lines.append(f"{pad}{key}: [{', '.join(_scalar(v) for v in value)}]")
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}")
    return "\n".join(lines)


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    text = str(v).replace('"', '\\"')
    return f'"{text}"'


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)

def write_aqn(layers: pd.DataFrame, path: str) -> str:
    config = aqn_config(layers)
    head = "# SRDD-guided AQN config written by srdd-compare (rules: docs/method.md)\n"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(head + to_yaml(config) + "\n")
    except OSError as exc:
        raise UserError(f"{path}: cannot write the AQN config ({exc.strerror or exc})") from exc
    return path
