"""Cross-check the baseline metrics with msprobe's own compare functions on the same tensors.

Run with a Python that has mindstudio-probe installed (a side environment that also sees this
project's packages; docs/benchmarks.md says how); msprobe is never a dependency of srdd-dump:

    /tmp/msprobe-venv/bin/python bench/peer_check.py

For each tensor pair (golden g, mine m) it computes Cosine, EucDist, MaxAbsErr, MaxRelativeErr
and the one/five-thousandths ratios with msprobe's validation and builtin algorithms (the path
``msprobe compare`` takes for a tensor pair), and srdd-compare's columns with the default
(msit) rules and with ``--metrics msprobe``, and prints every difference larger than float32
precision.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from srdd_dump.analysis.metrics import compare_arrays  # noqa: E402

RNG = np.random.default_rng(0)
COLUMNS = [  # (msprobe column, srdd-compare column)
    ("Cosine", "cosine_similarity"), ("EucDist", "euclidean_distance"),
    ("MaxAbsErr", "max_absolute_error"), ("MaxRelativeErr", "max_relative_error"),
    ("One Thousandth Err Ratio", "one_thousandth_err_ratio"),
    ("Five Thousandths Err Ratio", "five_thousandths_err_ratio"),
]


def bf16(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def pairs() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    g = RNG.standard_normal(4096).astype(np.float32)
    out = {
        "equal": (g, g.copy()),
        "fp32 noise 1e-6": (g, (g * (1 + 1e-6 * RNG.standard_normal(g.size))).astype(np.float32)),
        "fp32 noise 1e-3": (g, (g + 1e-3 * RNG.standard_normal(g.size)).astype(np.float32)),
        "bf16 rounding of fp32": (g, bf16(g)),
        "hidden state with an outlier": (np.r_[g, 2.5e4].astype(np.float32),
                                         np.r_[bf16(g), 2.4960e4].astype(np.float32)),
        "scaled 1.02 on 5% of channels": (g, np.where(np.arange(g.size) % 20 == 0, g * 1.02, g)
                                          .astype(np.float32)),
        "golden has exact zeros": (np.where(np.abs(g) < 0.1, 0, g).astype(np.float32),
                                   (g + 1e-4).astype(np.float32)),
        "zeros on both sides": (np.where(np.abs(g) < 0.1, 0, g).astype(np.float32),
                                np.where(np.abs(g) < 0.1, 0, g * (1 + 1e-5)).astype(np.float32)),
        "values around 1e-3": ((1e-3 * g).astype(np.float32),
                               (1e-3 * g * (1 + 2e-3 * RNG.standard_normal(g.size)))
                               .astype(np.float32)),
        "large values 1e4": ((1e4 * g).astype(np.float32), (1e4 * bf16(g)).astype(np.float32)),
        "mine all zero": (g, np.zeros_like(g)),
        "constant offset": (g, (g + 0.05).astype(np.float32)),
        "sign flip on 1%": (g, np.where(np.arange(g.size) % 100 == 0, -g, g).astype(np.float32)),
        "relative error exactly 0.001": (np.full(4096, 1000.0, np.float32),
                                         np.full(4096, 1001.0, np.float32)),
        "NaN at the same positions": (np.where(np.arange(g.size) % 97 == 0, np.nan, g)
                                      .astype(np.float32),
                                      np.where(np.arange(g.size) % 97 == 0, np.nan, g * 1.0001)
                                      .astype(np.float32)),
        "NaN at other positions": (g, np.where(np.arange(g.size) % 97 == 0, np.nan, g)
                                   .astype(np.float32)),
    }
    return out


def msprobe_metrics(g: np.ndarray, m: np.ndarray) -> dict[str, float | str]:
    from msprobe.core.common.const import CompareConst
    from msprobe.core.compare.npy_compare import CompareResult, ValidateTensor, compare_ops_apply

    columns = [c for c, _ in COLUMNS]
    checked = ValidateTensor().check_tensor(CompareResult(m.copy(), g.copy()))
    values, _ = compare_ops_apply(checked.n_value, checked.b_value, checked.error_flag,
                                  checked.err_msg, column_names=columns)
    out = {}
    for name, value in zip(columns, values):
        out[name] = value if not isinstance(value, str) or value != CompareConst.NAN else math.nan
    return out


def differs(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return str(a) != str(b)
    if math.isnan(a) and math.isnan(b):
        return False
    if math.isinf(a) or math.isinf(b):
        return a != b
    return abs(a - b) > 1e-6 * max(1.0, abs(a), abs(b))


def main() -> None:
    try:
        import msprobe  # noqa: F401
    except ImportError:
        sys.exit("peer_check: mindstudio-probe is not installed in this Python (see its docstring)")
    total = same_default = same_msprobe = 0
    for name, (g, m) in pairs().items():
        theirs = msprobe_metrics(g, m)
        ours = compare_arrays(g, m).metrics() | {"euclidean_distance":
                                                  compare_arrays(g, m).euclidean_distance}
        mine = compare_arrays(g, m, rules="msprobe")
        mine_values = mine.metrics() | {"euclidean_distance": mine.euclidean_distance}
        lines = []
        for theirs_name, column in COLUMNS:
            total += 1
            t, d, p = theirs[theirs_name], ours[column], mine_values[column]
            same_default += not differs(t, d)
            same_msprobe += not differs(t, p)
            if differs(t, d) or differs(t, p):
                lines.append(f"    {column}: msprobe {t}, srdd default {d:.9g}, "
                             f"srdd --metrics msprobe {p:.9g}")
        print(f"{name}: {'agree' if not lines else 'differ'}")
        print("\n".join(lines)) if lines else None
    print(f"\n{total} values: default rules agree on {same_default}, --metrics msprobe on "
          f"{same_msprobe}")


if __name__ == "__main__":
    main()
