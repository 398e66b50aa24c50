"""``--aqn-config aqn.yaml``: the SRDD-guided AQN configuration of a layer table, as YAML
(the rules: ``analysis.aqn``)."""

from __future__ import annotations

import json
import os

import pandas as pd

from ..analysis.aqn import BASE_SIGMA, HIGH_PRIORITY, layer_sigmas
from ..analysis.verdicts import FAULT
from ..errors import UserError


def aqn_config(layers: pd.DataFrame, base: float = BASE_SIGMA) -> dict:
    """The AQN config of a layer table (CompareResult.layers): per layer, the medians of its
    signals over the files go through ``analysis.aqn.layer_sigmas``."""
    per_layer = layers.groupby("layer")[["gain", "kurtosis", "instability"]].median()
    sigmas = layer_sigmas([int(k) for k in per_layer.index], per_layer["gain"].to_numpy(),
                          per_layer["kurtosis"].to_numpy(), per_layer["instability"].to_numpy(),
                          base)
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


def check_apart(path: str, report: str, inputs: tuple[str | None, ...] = ()) -> None:
    """UserError when the AQN config ``path`` is a file of the report at ``report``, one of the
    ``inputs`` (a dump file, or a file a dump folder's readers take: writing it would replace
    that file, or add one the next compare reads)."""
    from . import report_files

    same = [p for p in report_files(report) if os.path.realpath(p) == os.path.realpath(path)]
    if same:
        raise UserError(f"--aqn-config {path}: a file of the report ({same[0]}); give the AQN "
                        "config a name of its own")
    where = os.path.realpath(path)
    for given in filter(None, inputs):
        root = os.path.realpath(given)
        inside = os.path.isdir(root) and where.startswith(root.rstrip(os.sep) + os.sep)
        if where == root or (inside and where.endswith(DUMP_NAMES)):
            what = ("an input" if where == root
                    else f"a file name the dumps in {given} are read from")
            raise UserError(f"--aqn-config {path}: {what}; give the AQN config a name of its "
                            "own")


# names srdd-compare reads in a dump folder (its own dumps, msprobe's)
DUMP_NAMES = (".h5", ".h5.partial", ".pt", ".npy", "dump.json")


def write_aqn(layers: pd.DataFrame, path: str) -> str:
    """Write the AQN config of ``layers`` to ``path`` (YAML; JSON for a ``.json`` name, which
    YAML's comment line would make unreadable); returns the path."""
    config = aqn_config(layers)
    if path.lower().endswith(".json"):
        text = json.dumps(config, indent=2)
    else:
        head = "# SRDD-guided AQN config written by srdd-compare (rules: docs/method.md)\n"
        text = head + to_yaml(config)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text + "\n")
    except OSError as exc:
        raise UserError(f"{path}: cannot write the AQN config ({exc.strerror or exc})") from exc
    return path
