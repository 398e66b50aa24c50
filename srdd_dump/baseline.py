"""GPU-baseline mode: compare my dumps (e.g. from an NPU) layer by layer with golden dumps.

``compare_baseline`` pairs files (by rank, else in order; one golden file serves every file of
mine), samples (by input hash, then order), rounds (same step) and layers (module name, then
index), computes msit's metrics and more for every pair of clean block-output records, and
judges each row (analysis.tolerance) and the run (analysis.divergence). Each record is read in
blocks of rows, so memory does not grow with the dump; ``jobs`` > 1 shares the tasks (up to
TASK_ROWS rows of one file pair and layer) between this process and ``jobs - 1`` workers, which
run baseline_rows.py only. numpy + h5py + pandas only: never imports torch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .analysis.divergence import BaselineSummary, mark_divergence, summarize
from .analysis.matching import DIFFER, RoundPair, pair_layers, pair_rounds
from .analysis.metrics import METRIC_NAMES
from .analysis.tolerance import FAIL, WARN, Thresholds
from .baseline_rows import TASK_ROWS, _run_task, _Spec, _Task
from .errors import UserError
from .format import schema as s
from .format.reader import DumpError, DumpReader, find_dump_files
from .memory import keep_freed_memory
from .pool import run_tasks
from .report.baseline_report import BASELINE_COLUMNS, DERIVED_COLUMNS, FILE_COLUMNS, writer_for
from .report.table import INCOMPLETE, OK, SKIPPED
from .streaming import clean_block_records

STACK_MODULE = "(stack input)"


@dataclass
class BaselineResult:
    path: str  # my dumps, as given
    baseline: str  # golden dumps, as given
    table: pd.DataFrame  # BASELINE_COLUMNS, in (source, sample, step, layer) order
    files: pd.DataFrame  # FILE_COLUMNS, one row per dump file of either side
    summary: BaselineSummary
    thresholds: Thresholds
    written: list[str] = field(default_factory=list)

    @property
    def skipped_reasons(self) -> list[str]:
        return list(self.files.loc[self.files["status"] == SKIPPED, "reason"])

    def worst_verdict(self) -> str:
        """In compare's vocabulary, for ``--fail-on``: a FAIL row -> FAULT, WARN -> SUSPECT."""
        verdicts = set(self.table["verdict"])
        return "FAULT" if FAIL in verdicts else "SUSPECT" if WARN in verdicts else "NORMAL"


@dataclass
class _File:
    """What the planner needs of one dump file; plain data, so it pickles to workers."""

    path: str
    source: str
    role: str  # "my" or "golden"
    layers: list[str] = field(default_factory=list)
    rounds: np.ndarray | None = None
    records: dict[tuple[int, int], int] = field(default_factory=dict)
    rank: int | None = None
    pid: int | None = None
    status: str = OK
    reason: str = ""
    paired_with: str = ""


def compare_baseline(
    target_path: str,
    baseline_path: str,
    output: str | None = None,
    thresholds: Thresholds | None = None,
    jobs: int = 1,
    *,
    progress: bool | None = None,
) -> BaselineResult:
    """Compare every dump under ``target_path`` (mine) with those under ``baseline_path``.

    ``output`` ending in .csv or .xlsx writes the report there (None: nothing written).
    ``thresholds`` overrides the dtype-aware verdict limits; ``jobs`` > 1 uses that many
    worker processes. Raises UserError on bad arguments or when either side has no usable file.
    """
    thresholds = (thresholds or Thresholds()).validate()
    keep_freed_memory()
    if jobs < 1:
        raise UserError(f"--jobs {jobs}: must be at least 1")
    write = writer_for(output) if output is not None else None
    mine = _open_side(target_path, "my")
    golden = _open_side(baseline_path, "golden")
    pairs = _pair_files(mine, golden)
    show = sys.stderr.isatty() if progress is None else progress
    tasks = _plan(pairs, thresholds)
    rows = [row for part in run_tasks(_run_task, tasks, jobs, show=show) for row in part]
    table = _table(rows)
    files = pd.DataFrame([_file_row(f) for f in mine + golden], columns=FILE_COLUMNS)
    for col in ("rounds", "samples", "layers", "rank", "pid"):
        files[col] = files[col].astype("Int64")
    result = BaselineResult(
        path=target_path, baseline=baseline_path, table=table, files=files,
        summary=summarize(table), thresholds=thresholds,
    )
    if write is not None:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
            result.written = write(result, output)
        except OSError as exc:
            raise UserError(f"{output}: cannot write the report ({exc.strerror or exc})") from exc
    return result


# -- files -------------------------------------------------------------------------------------


def _open_side(path: str, role: str) -> list[_File]:
    label = "--baseline " if role == "golden" else ""
    if not os.path.exists(path):
        raise UserError(f"{label}{path}: no such file or directory")
    found = find_dump_files(path)
    if not found:
        raise UserError(f"{label}{path}: no dump files (*.h5 or *.h5.partial) found")
    root = path if os.path.isdir(path) else os.path.dirname(path)
    files = [_inspect(f, os.path.relpath(f, root) if root else f, role) for f in found]
    if not any(f.status != SKIPPED for f in files):
        reason = files[0].reason
        raise UserError(reason if len(files) == 1 else
                        f"{label}{path}: none of the {len(files)} dump files is usable; {reason}")
    return files


def _inspect(path: str, source: str, role: str) -> _File:
    f = _File(path=path, source=source, role=role)
    try:
        reader = DumpReader(path)
    except DumpError as exc:
        f.status, f.reason = SKIPPED, str(exc)
        return f
    with reader:
        f.layers, f.rounds = list(reader.layers), reader.rounds
        f.rank, f.pid = reader.meta_int("rank"), reader.meta_int("pid")
        f.records = clean_block_records(reader)
        if not f.records:
            f.status, f.reason = SKIPPED, f"{path}: no captured layer data"
        elif not reader.complete:
            f.status, f.reason = INCOMPLETE, f"{path}: capture did not finish; rounds written used"
    return f


def _pair_files(mine: list[_File], golden: list[_File]) -> list[tuple[_File, _File]]:
    """One golden file serves all of mine; else pair by rank, then in order."""
    my_ok = [f for f in mine if f.status != SKIPPED]
    golden_ok = [f for f in golden if f.status != SKIPPED]
    pairs: list[tuple[_File, _File]] = []
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
                f.status, f.reason = SKIPPED, f"{f.path}: no golden dump file left to pair with"
        for g in left:
            g.reason = g.reason or f"{g.path}: no dump file of mine to pair with"
    for f, g in pairs:
        f.paired_with = g.source
        g.paired_with = ", ".join(x for x in (g.paired_with, f.source) if x)
    return sorted(pairs, key=lambda p: mine.index(p[0]))


def _file_row(f: _File) -> dict:
    rounds = f.rounds if f.rounds is not None else np.zeros(0, s.ROUND_DTYPE)
    return {
        "role": f.role, "source": f.source, "status": f.status, "reason": f.reason,
        "paired_with": f.paired_with, "rounds": len(rounds),
        "samples": len(np.unique(rounds["sample"])), "layers": len(f.layers),
        "rank": f.rank, "pid": f.pid,
    }


# -- planning ----------------------------------------------------------------------------------


def _plan(pairs: list[tuple[_File, _File]], thresholds: Thresholds) -> list[_Task]:
    """Row specs grouped into tasks of one (file pair, layer pair) each."""
    tasks: dict[tuple, _Task] = {}
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
                spec = _Spec((p, r, -2), keys, None, None, False, rp.reason)
                tasks.setdefault((p, "rounds"), _Task(mine.path, golden.path, thresholds, []))
                tasks[(p, "rounds")].specs.append(spec)
                continue
            for k, (i, j) in enumerate(layer_pairs):
                spec = _layer_spec(mine, golden, rp, i, j, base)
                spec.order = (p, r, k)
                key = (p, i, j)
                tasks.setdefault(key, _Task(mine.path, golden.path, thresholds, []))
                tasks[key].specs.append(spec)
    # at most TASK_ROWS rows a task: the processes of -j N finish together
    return [_Task(task.my_path, task.golden_path, task.thresholds, task.specs[i: i + TASK_ROWS])
            for task in tasks.values() for i in range(0, len(task.specs), TASK_ROWS)]


def _has_layer(f: _File, layer: int) -> bool:
    return any(k[1] == layer for k in f.records)


def _layer_spec(
    mine: _File, golden: _File, rp: RoundPair, i: int | None, j: int | None, base: dict
) -> _Spec:
    keys = dict(
        base, layer=i, module=_module(mine, i), golden_layer=j, golden_module=_module(golden, j)
    )
    my_rec = mine.records.get((rp.round, i)) if i is not None else None
    golden_rec = golden.records.get((rp.golden_round, j)) if j is not None else None
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
    return _Spec((), keys, my_rec, golden_rec, not reason, reason)


def _module(f: _File, layer: int | None) -> str:
    if layer is None:
        return ""
    if layer == s.STACK_INPUT:
        return STACK_MODULE
    return f.layers[layer] if 0 <= layer < len(f.layers) else ""


# -- the table ---------------------------------------------------------------------------------


def _table(rows: list[dict]) -> pd.DataFrame:
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
    df = mark_divergence(df)
    return df[BASELINE_COLUMNS].reset_index(drop=True)

