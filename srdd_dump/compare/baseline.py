"""GPU-baseline mode: compare my dumps (e.g. from an NPU) layer by layer with golden dumps.

Files are paired (by rank, else in order; one golden file serves every file of mine), then
samples (by input hash, then order), rounds (same step) and layers (module name, then index).
Each task computes msit's metrics and more for up to TASK_ROWS pairs of clean block-output
records of one file pair and layer (``baseline_task``); the rows are judged one by one
(analysis.tolerance) and the run as a whole (``divergence``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..analysis.matching import DIFFER, RoundPair, pair_layers, pair_rounds
from ..analysis.metrics import METRIC_NAMES
from ..analysis.tolerance import Thresholds
from ..format import schema as s
from .baseline_task import TASK_ROWS, RowSpec, RowTask
from .divergence import mark_divergence, summarize
from .results import (
    BASELINE_COLUMNS,
    BASELINE_FILE_COLUMNS,
    DERIVED_COLUMNS,
    INCOMPLETE,
    SKIPPED,
    BaselineResult,
)
from .sources import DumpFile


@dataclass(eq=False)
class Side:
    """One dump file of either side, with its role and pairing."""

    file: DumpFile
    role: str  # "my" or "golden"
    paired_with: str = ""

    def __getattr__(self, name):  # the DumpFile's fields
        return getattr(self.file, name)


def prepare(mine: list[DumpFile], golden: list[DumpFile]) -> tuple[list[Side], list[Side]]:
    """Both sides as Side rows, with the baseline mode's wording of an incomplete file."""
    sides = []
    for files, role in ((mine, "my"), (golden, "golden")):
        rows = []
        for f in files:
            if f.usable and not f.clean_blocks and f.stats_index is not None:
                f.status, f.reason = SKIPPED, (
                    f"{f.path}: a stats dump without rows (--store stats:0); the baseline mode "
                    "compares tensors: dump with --store stats (2 rows of each block), "
                    "sample:N or full")
            elif f.usable and not f.clean_blocks:
                f.status, f.reason = SKIPPED, f"{f.path}: no captured layer data"
            elif f.status == INCOMPLETE:
                f.reason = f"{f.path}: capture did not finish; rounds written used"
            rows.append(Side(f, role))
        sides.append(rows)
    return sides[0], sides[1]


def store_notes(sides: list[Side]) -> list[str]:
    """One line per stats dump compared: its rows are a seeded sample, not every token."""
    return [f"{f.source}: a stats dump (--store stats): the baseline compares the seeded rows "
            "of each block output it kept, not every token (for every row: --store sample:N "
            "or full)" for f in sides if f.usable and f.stats_index is not None]


def finish(path: str, baseline: str, mine: list[Side], golden: list[Side],
           thresholds: Thresholds, parts: list[list[dict]],
           same_device: set[tuple[str, str]] | None = None) -> BaselineResult:
    """``same_device``: (source, golden source) pairs that ran on one device type, where a
    non-zero error from an exactly equal input is the birth of an error."""
    table = _table([row for part in parts for row in part], same_device)
    files = pd.DataFrame([_file_row(f) for f in mine + golden], columns=BASELINE_FILE_COLUMNS)
    for col in ("rounds", "samples", "layers", "rank", "pid"):
        files[col] = files[col].astype("Int64")
    return BaselineResult(path=path, baseline=baseline, table=table, files=files,
                          summary=summarize(table, same_device), thresholds=thresholds)


# -- files -------------------------------------------------------------------------------------


def pair_files(mine: list[Side], golden: list[Side]) -> list[tuple[Side, Side]]:
    """One golden file serves all of mine; else pair by rank, then in order."""
    my_ok = [f for f in mine if f.usable]
    golden_ok = [f for f in golden if f.usable]
    pairs: list[tuple[Side, Side]] = []
    if len(golden_ok) == 1:
        pairs = [(f, golden_ok[0]) for f in my_ok]
    else:
        left = list(golden_ok)
        by_rank = {}
        for g in golden_ok:
            if g.rank is not None:
                by_rank.setdefault(g.rank, g)
        unpaired = []
        for f in my_ok:
            g = by_rank.get(f.rank) if f.rank is not None else None
            if g is not None and g in left:
                left.remove(g)
                pairs.append((f, g))
            else:
                unpaired.append(f)
        for f in unpaired:
            if left:
                pairs.append((f, left.pop(0)))
            else:
                f.file.status = SKIPPED
                f.file.reason = f"{f.path}: no golden dump file left to pair with"
        for g in left:
            g.file.reason = g.reason or f"{g.path}: no dump file of mine to pair with"
    for f, g in pairs:
        f.paired_with = g.source
        g.paired_with = ", ".join(x for x in (g.paired_with, f.source) if x)
    return sorted(pairs, key=lambda p: mine.index(p[0]))


def _file_row(f: Side) -> dict:
    rounds = f.rounds
    return {
        "role": f.role, "source": f.source, "status": f.status, "reason": f.reason,
        "paired_with": f.paired_with, "rounds": len(rounds),
        "samples": len(np.unique(rounds["sample"])), "layers": len(f.layers),
        "rank": f.rank, "pid": f.pid,
    }


# -- planning ----------------------------------------------------------------------------------


def plan(pairs: list[tuple[Side, Side]], thresholds: Thresholds) -> list[RowTask]:
    """Row specs grouped into tasks of one (file pair, layer pair) each."""
    tasks: dict[tuple, RowTask] = {}
    for p, (mine, golden) in enumerate(pairs):
        layer_pairs = pair_layers(mine.layers, golden.layers)
        if _has_layer(mine, s.STACK_INPUT) or _has_layer(golden, s.STACK_INPUT):
            layer_pairs = [(s.STACK_INPUT, s.STACK_INPUT)] + layer_pairs
        for r, rp in enumerate(pair_rounds(mine.rounds, golden.rounds)):
            base = {
                "source": mine.source, "golden_source": golden.source, "sample": rp.sample,
                "golden_sample": rp.golden_sample, "step": rp.step, "input_match": rp.input_match,
            }
            if rp.round is None or rp.golden_round is None:
                keys = dict(base, layer=None, module="", golden_layer=None, golden_module="")
                spec = RowSpec((p, r, -2), keys, None, None, False, rp.reason)
                tasks.setdefault((p, "rounds"), RowTask(mine.path, golden.path, thresholds, []))
                tasks[(p, "rounds")].specs.append(spec)
                continue
            for k, (i, j) in enumerate(layer_pairs):
                spec = _layer_spec(mine, golden, rp, i, j, base)
                spec.order = (p, r, k)
                key = (p, i, j)
                tasks.setdefault(key, RowTask(mine.path, golden.path, thresholds, []))
                tasks[key].specs.append(spec)
    # at most TASK_ROWS rows a task: the processes of -j N finish together
    return [RowTask(task.my_path, task.golden_path, task.thresholds, task.specs[i: i + TASK_ROWS])
            for task in tasks.values() for i in range(0, len(task.specs), TASK_ROWS)]


def _has_layer(f: Side, layer: int) -> bool:
    return any(k[1] == layer for k in f.clean_blocks)


def _layer_spec(
    mine: Side, golden: Side, rp: RoundPair, i: int | None, j: int | None, base: dict
) -> RowSpec:
    keys = dict(
        base, layer=i, module=mine.module(i), golden_layer=j, golden_module=golden.module(j)
    )
    my_rec = mine.clean_blocks.get((rp.round, i)) if i is not None else None
    golden_rec = golden.clean_blocks.get((rp.golden_round, j)) if j is not None else None
    reason = ""
    if i is None:
        reason = f"no counterpart: golden layer {j} ({keys['golden_module']}) is not in my dump"
    elif j is None:
        reason = f"no counterpart: my layer {i} ({keys['module']}) is not in the golden dump"
    elif my_rec is None or golden_rec is None:
        side = "my" if my_rec is None else "golden"
        reason = f"missing record: no {side} data for this layer in this round"
    elif rp.input_match == DIFFER:
        reason = (
            "inputs differ: the input ids of this round (or an earlier one of the sample) are "
            "not those of the golden run, so the tensors are not compared"
        )
    return RowSpec((), keys, my_rec, golden_rec, not reason, reason,
                   my_mask=mine.masks.get(rp.round), golden_mask=golden.masks.get(rp.golden_round))


# -- the table ---------------------------------------------------------------------------------


def _table(rows: list[dict], same_device: set[tuple[str, str]] | None = None) -> pd.DataFrame:
    rows = sorted(rows, key=lambda r: r["_order"])
    columns = [c for c in BASELINE_COLUMNS if c not in DERIVED_COLUMNS]
    df = pd.DataFrame(rows, columns=columns)
    for col in ("sample", "golden_sample", "step", "layer", "golden_layer", "golden_nan_inf",
                "my_nan_inf"):
        df[col] = df[col].astype("Int64")
    for col in (*METRIC_NAMES, "golden_max_value", "golden_min_value", "golden_mean_value",
                "my_max_value", "my_min_value", "my_mean_value"):
        df[col] = df[col].astype(float)
    for col in ("module", "golden_module", "input_match", "golden_dtype", "golden_shape",
                "my_dtype", "my_shape", "cmp_fail_reason", "tolerance"):
        df[col] = df[col].astype(object).where(df[col].notna(), "").astype(str)
    df = mark_divergence(df, same_device)
    return df[BASELINE_COLUMNS].reset_index(drop=True)

