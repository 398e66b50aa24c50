"""``--aqn-config aqn.yaml``: write the SRDD-guided AQN configuration."""

from __future__ import annotations

import os

import pandas as pd

from ..analysis.aqn import aqn_config, to_yaml
from ..errors import UserError


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
