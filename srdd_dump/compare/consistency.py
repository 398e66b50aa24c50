"""Consistency mode: among the dump files of one folder, find the odd card out, reference-free.

The files that ran the same model (same layer names) in the same dtype on the same inputs
(same token-ids hashes per sample) form a group (separate runs in another dtype are no cards
of the same run); for every group of three or more, each source is compared layer by
layer, over every round they share, with the element-wise median of the others
(analysis.consistency). It names the sources that depart and the first layer where each
departs. Records are streamed in blocks; one task per (group, layer).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..analysis.tolerance import Thresholds, tolerance_dtype
from ..format import schema as s
from ..format.layer_numbers import layer_numbers, number_of
from .consistency_task import ConsistencyTask
from .results import CONSISTENCY_COLUMNS, CONSISTENCY_SUMMARY_COLUMNS, ConsistencyResult
from .sources import DumpFile

if TYPE_CHECKING:  # its tables: pandas, imported once a group is found (a one-card compare
    import pandas as pd  # needs none)

MIN_SOURCES = 3
@dataclass
class _Source:
    file: DumpFile
    rounds: dict[tuple[int, int, int], int]  # (sample hash, step, round hash) -> round
    samples: frozenset  # token-ids hashes of the samples' first rounds

    @property
    def source(self) -> str:
        return self.file.source

    @property
    def layers(self) -> list[str]:
        return self.file.layers

    @property
    def records(self) -> dict[tuple[int, int], int]:
        return self.file.clean_blocks


def plan(groups: list[list[_Source]], thresholds: Thresholds | None = None
         ) -> tuple[list[ConsistencyTask], list[list[_Source]], list[str]]:
    """Tasks of every group (``group_sources``) of 3+ sources; the groups and their tolerance
    dtypes. No tasks: no such group."""
    thresholds = (thresholds or Thresholds()).validate()
    groups = [g for g in groups if len(g) >= MIN_SOURCES]
    tasks: list[ConsistencyTask] = []
    kept: list[list[_Source]] = []
    tolerance: list[str] = []
    for members in groups:
        common = set.intersection(*(set(m.rounds) for m in members))
        if not common:
            continue
        keys = sorted(common, key=lambda k: members[0].rounds[k])
        limits = thresholds.limits(*_least_precise(members))
        # tensor parallel: a block whose output is each rank's own part differs by design
        sharded = set().union(*(m.file.sharded_layers for m in members))
        layers = [i for i in range(len(members[0].layers)) if i not in sharded]
        if all(any(k[1] == s.STACK_INPUT for k in m.records) for m in members):
            layers = [s.STACK_INPUT] + layers
        for layer in layers:
            recs = [[m.records.get((m.rounds[k], layer), -1) for m in members] for k in keys]
            tasks.append(ConsistencyTask(len(kept), layer, [m.file.path for m in members], recs,
                               limits.rel_dist_warn, limits.floor))
        kept.append(members)
        tolerance.append(limits.tolerance)
    return tasks, kept, tolerance


def without_ids(files: list[DumpFile]) -> list[str]:
    """A note when MIN_SOURCES or more files hold block outputs but some recorded no input ids
    (msprobe dumps of outputs only): the multi-card check cannot tell that they ran the same
    inputs, so it leaves them out."""
    usable = [f for f in files if f.usable and f.clean_blocks]
    blind = [f for f in usable if _source(f) is None]
    if len(usable) < MIN_SOURCES or not blind:
        return []
    fix = (" (msprobe: data_mode all, with the model's class in the list, records them)"
           if any(f.origin for f in blind) else "")
    return [f"{len(blind)} of {len(usable)} files recorded no input ids: the multi-card check "
            f"(the odd card out among cards that ran the same inputs) left them out{fix}"]


ONE_PROCESS = re.compile(r"^(srdd_rank\d+_pid(\d+))(?:_\d+)?\.h5$")


def _one_process(pair: list[_Source]) -> str | None:
    """The pid of two files one process wrote in one folder (register_hook twice:
    srdd_rank0_pid<N>.h5 and srdd_rank0_pid<N>_1.h5); None for files of two processes."""
    found = [ONE_PROCESS.match(os.path.basename(m.file.path)) for m in pair]
    folders = {os.path.dirname(os.path.abspath(m.file.path)) for m in pair}
    hosts = {m.file.host for m in pair}  # two containers reuse pids, not host names
    if all(found) and len({f[1] for f in found}) == 1 and len(folders) == 1 \
            and len(hosts) == 1:
        return found[0][2]
    return None


def too_few(groups: list[list[_Source]]) -> list[str]:
    """A note for each group of two sources: the check needs three (the median of the others
    is then one card, and a difference names neither)."""
    notes = []
    for pair in groups:
        if len(pair) != 2 or not set(pair[0].rounds) & set(pair[1].rounds):
            continue
        if any(m.file.sharded_layers for m in pair):  # tensor-parallel ranks: parts by design
            continue
        (a, b), (path_a, path_b) = ((m.source for m in pair),
                                    (shlex.quote(m.file.path) for m in pair))
        pid = _one_process(pair)
        why = (f"are two capture sessions of one process (pid {pid}), the same model on the "
               "same inputs" if pid else
               f"ran the same model on the same inputs: the multi-card check needs "
               f"{MIN_SOURCES} such cards (of two that differ, neither can be named the odd "
               "one)")
        notes.append(f"{a} and {b} {why}; to see where these two part: srdd-compare "
                     f"{path_a} --baseline {path_b}")
    return notes


def group_sources(files: list[DumpFile]) -> list[list[_Source]]:
    """The sources of the same model (class and layer names), inputs and block dtype,
    grouped; files without recorded input ids are left out."""
    grouped: dict[tuple, list[_Source]] = {}
    for src in filter(None, map(_source, files)):
        grouped.setdefault((src.file.model_class, tuple(src.layers), src.samples,
                            src.file.block_dtype()), []).append(src)
    return list(grouped.values())


def finish(tasks: list[ConsistencyTask], groups: list[list[_Source]], tolerance: list[str],
           parts: list[tuple[list[dict], int, int]]) -> ConsistencyResult:
    rows, skipped = [], 0
    numbers = {id(m): layer_numbers(m.file.layers) for g in groups for m in g}
    for task, (results, n_rounds, n_skipped) in zip(tasks, parts):
        skipped += n_skipped
        members = groups[task.group]
        for src, res in zip(members, results):
            rows.append(dict(
                res, group=task.group, source=src.source,
                layer=number_of(numbers[id(src)], task.layer),
                module=src.file.module(task.layer), rounds=n_rounds,
                tolerance=tolerance[task.group],
            ))
    table = _table(rows)
    summary = _summary(table, groups)
    return ConsistencyResult(
        table=table, summary=summary, groups=[[m.source for m in g] for g in groups],
        messages=_messages(table, summary), skipped_rounds=skipped,
    )


def _source(f: DumpFile) -> _Source | None:
    if not f.usable or not f.clean_blocks:
        return None
    rows = sorted(f.rounds, key=lambda r: (int(r["sample"]), int(r["step"])))
    first: dict[int, int] = {}
    rounds: dict[tuple[int, int, int], int] = {}
    for r in rows:
        sample_hash = first.setdefault(int(r["sample"]), int(r["tokens_hash"]))
        if not sample_hash or not int(r["tokens_hash"]):
            return None  # input ids not recorded: the inputs cannot be checked
        rounds[(sample_hash, int(r["step"]), int(r["tokens_hash"]))] = int(r["round"])
    return _Source(file=f, rounds=rounds, samples=frozenset(first.values()))


def _least_precise(members: list[_Source]) -> tuple[str, str]:
    dtype = members[0].file.block_dtype()
    for m in members[1:]:
        dtype = tolerance_dtype(dtype, m.file.block_dtype())
    return dtype, dtype


def _table(rows: list[dict]) -> pd.DataFrame:
    import pandas as pd

    df = pd.DataFrame(rows, columns=[c for c in CONSISTENCY_COLUMNS if c != "first_departure"])
    df = df.sort_values(["group", "layer", "source"], kind="mergesort").reset_index(drop=True)
    df["first_departure"] = False
    departing = df[df["departs"]]
    if len(departing):
        first = departing.groupby(["group", "source"], sort=False)["layer"].idxmin()
        df.loc[first.to_numpy(), "first_departure"] = True
    return df[CONSISTENCY_COLUMNS]


def _summary(table: pd.DataFrame, groups: list[list[_Source]]) -> pd.DataFrame:
    import pandas as pd

    rows = []
    for g, members in enumerate(groups):
        part = table[table["group"] == g]
        for m in members:
            mine = part[part["source"] == m.source]
            first = mine[mine["first_departure"]]
            worst = mine.loc[mine["relative_error"].idxmax()] if len(mine) else None
            rows.append({
                "group": g, "source": m.source, "sources": len(members),
                "rounds": int(mine["rounds"].max()) if len(mine) else 0,
                "odd": bool(len(first)),
                "first_departing_layer": int(first["layer"].iloc[0]) if len(first) else None,
                "first_departing_module": str(first["module"].iloc[0]) if len(first) else "",
                "worst_layer": None if worst is None else int(worst["layer"]),
                "max_relative_error": np.nan if worst is None else float(worst["relative_error"]),
            })
    df = pd.DataFrame(rows, columns=CONSISTENCY_SUMMARY_COLUMNS)
    for col in ("first_departing_layer", "worst_layer"):
        df[col] = df[col].astype("Int64")
    return df


def _messages(table: pd.DataFrame, summary: pd.DataFrame) -> list[str]:
    out = []
    for g, part in summary.groupby("group", sort=True):
        odd = part[part["odd"]].sort_values("first_departing_layer", kind="mergesort")
        rows = table[table["group"] == g]
        n = len(part)
        if odd.empty:
            out.append(
                f"group {g}: all {n} sources agree (largest relative error to the median of "
                f"the others {rows['relative_error'].max():.3g}, at "
                f"{rows['tolerance'].iloc[0]} tolerance)"
            )
            continue
        if len(odd) == 1:
            o = odd.iloc[0]
            at = rows[(rows["source"] == o["source"]) & rows["first_departure"]].iloc[0]
            out.append(
                f"group {g}: odd card out: {o['source']} departs from the other {n - 1} sources "
                f"first at layer {int(at['layer'])} ({at['module']}): relative error "
                f"{at['relative_error']:.3g} to the median of the others, whose own spread is "
                f"{at['others_relative_error']:.3g}"
                + (f"; {int(at['nan_inf'])} NaN/Inf the others do not have" if at["nan_inf"]
                   else "")
            )
            continue
        names = ", ".join(
            f"{o['source']} (layer {int(o['first_departing_layer'])})" for _, o in odd.iterrows()
        )
        out.append(f"group {g}: {len(odd)} of {n} sources depart: {names}")
    return out
