"""Compare dumps offline: find and inspect the dump files once, plan a mode's tasks, run them in
the one scan loop (``pipeline.scan``), return a typed result (``results``). Nothing here writes a
file: ``srdd_dump.report`` renders the results.

    result = compare_path("dumps/")                      # reference-free (+ consistency)
    result = compare_baseline("npu_dumps/", "gpu_dumps/")  # GPU-baseline

numpy + h5py + pandas only: nothing under this package imports torch. The names are imported
on first use, so a worker process that needs one task module does not load pandas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .api import check_consistency, compare_baseline, compare_path, file_signals
    from .results import BaselineResult, CompareResult, ConsistencyResult

__all__ = [
    "BaselineResult", "CompareResult", "ConsistencyResult", "check_consistency",
    "compare_baseline", "compare_path", "file_signals",
]


def __getattr__(name: str):
    if name in ("compare_path", "compare_baseline", "check_consistency", "file_signals"):
        from . import api

        return getattr(api, name)
    if name in ("BaselineResult", "CompareResult", "ConsistencyResult"):
        from . import results

        return getattr(results, name)
    raise AttributeError(name)
