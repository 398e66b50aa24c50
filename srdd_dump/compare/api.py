"""The three compare modes, each: find the files once, plan, ``pipeline.scan``, finish.

The modules of the result tables are imported where a mode needs them. The reference-free
mode's tables are rows (no pandas, 0.15 s of CPU to import, unless a DataFrame is asked for);
the baseline mode's are DataFrames.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..analysis.signals import Signals, set_kurtosis_change
from ..analysis.tolerance import Thresholds
from ..errors import UserError
from ..format.layer_numbers import after_gap, layer_numbers

# the modes' modules by their own names, never through the package (its __init__ re-exports
# this module's functions: importing it here would be an import circle)
from .early import SIGNAL_TASKS
from .early import plan as plan_reference_free
from .pipeline import (
    check_jobs,
    default_jobs,
    discard_started,
    prestart,
    scan,
)
from .readers import close_readers
from .signal_reader import run_task as run_signal_task
from .sources import find_sources, inspect, inspect_all, locate, no_usable_file

if TYPE_CHECKING:
    from .results import BaselineResult, CompareResult, ConsistencyResult

def compare_path(path: str, *, jobs: int | None = 1, progress: bool | None = None,
                 run: str | None = None) -> CompareResult:
    """Reference-free diagnosis of every dump file (``*.h5``, ``*.h5.partial``) under ``path``
    (a folder or a file), and the multi-card consistency check when 3+ of them ran the same
    inputs.

    Unreadable files are skipped with their reason in the file table; files cut short by a
    crash are used and marked incomplete. ``progress`` (default: on) shows a bar on stderr
    when it is a terminal. ``jobs`` > 1 shares the work with ``jobs - 1`` spawned worker
    processes (None: as many as the cores this process may use, bounded by the work). A
    folder holding several runs: the newest, or ``run`` (see ``sources.find_sources``).
    Raises UserError when there is nothing usable to report.
    """
    show = _show(progress)
    try:
        paths, root, note = locate(path, run=run)
        jobs = default_jobs(paths) if jobs is None else jobs
        jobs = check_jobs(jobs)
        prestart(jobs, SIGNAL_TASKS)  # the workers start while the files are inspected
        found = inspect_all(paths, root, note)
        files = found.files
        tasks = plan_reference_free(files, jobs)
        results = scan(run_signal_task, tasks, jobs, progress=show, desc="reference-free")
        from .reference_free import finish as finish_reference_free

        result = finish_reference_free(path, files, tasks, results)
        result.notes = ([found.note] if found.note else []) + [
            note for f in files if f.usable for note in f.capture_notes] + result.notes
        result.missing_evidence = [line for f in files if f.usable
                                   for line in f.missing_evidence]
        if result.layer_table.empty:
            raise no_usable_file(result.file_table.column("reason"), path, under=True)
        from .consistency import group_sources, too_few, without_ids

        groups = group_sources(files)
        result.consistency = _consistency(groups, None, jobs, show)
        result.notes += too_few(groups) + without_ids(files)
        return result
    finally:
        discard_started()
        close_readers()


def file_signals(path: str, *, jobs: int = 1) -> list[Signals]:
    """The reference-free signals of every block and sub-layer of one dump file, in (layer,
    site) order, as the diagnosis sees them. ``Signals.layer`` is the block's position in the
    file, as the diagnosis takes it; ``format.layer_numbers`` gives the model's numbers the
    reports show (a dump of some blocks: position 0 may be layer 10)."""
    jobs = check_jobs(jobs)
    try:
        f = inspect(path, path)
        if not f.usable:
            raise UserError(f.reason)
        tasks = plan_reference_free([f], jobs)
        parts = scan(run_signal_task, tasks, jobs)
    finally:
        close_readers()
    failed = [p for p in parts if isinstance(p, str)]
    if failed:
        raise UserError(failed[0])
    signals = sorted((g for p in parts for g in p if g.layer >= 0),
                     key=lambda g: (g.layer, g.site))
    set_kurtosis_change(signals, after_gap(layer_numbers(f.layers)))
    return signals


def compare_baseline(
    target_path: str, baseline_path: str, thresholds: Thresholds | None = None, *,
    jobs: int | None = 1, progress: bool | None = None, run: str | None = None,
    baseline_run: str | None = None, mapping: str | None = None,
) -> BaselineResult:
    """Compare every dump of one run under ``target_path`` (mine) with those of one run under
    ``baseline_path`` (golden), layer by layer. ``thresholds`` overrides the dtype-aware verdict
    limits; ``run`` / ``baseline_run`` choose a run of a folder that holds several (default:
    the newest); ``jobs`` None: the cores this process may use; ``mapping``: a YAML file pairing
    sites the automatic pairing does not (compare/mapping_file.py). Raises UserError on bad
    arguments or when either side has no usable file."""
    from .mapping_file import read_mapping

    thresholds = (thresholds or Thresholds()).validate()
    rules = read_mapping(mapping) if mapping is not None else ()
    try:
        return _compare_baseline(target_path, baseline_path, thresholds, jobs, progress, run,
                                 baseline_run, rules)
    finally:
        close_readers()


def _compare_baseline(target_path, baseline_path, thresholds, jobs, progress, run,
                      baseline_run, rules) -> BaselineResult:
    from .baseline import finish as finish_baseline
    from .baseline import (
        model_notes,
        other_rank_notes,
        pair_files,
        prepare,
        rank_notes,
        same_file_notes,
        store_notes,
        unpaired_notes,
        unused_rule_notes,
    )
    from .baseline import plan as plan_baseline
    from .baseline_task import run_task as run_row_task

    sides, notes = [], []
    for path, option, name in ((target_path, "", run),
                               (baseline_path, "--baseline ", baseline_run)):
        found = find_sources(path, option, name)
        sides.append(found.files)
        notes += [found.note] if found.note else []
    jobs = default_jobs(sides[0] + sides[1]) if jobs is None else jobs
    jobs = check_jobs(jobs)
    mine, golden = prepare(*sides)
    notes += store_notes(mine + golden)
    notes += [note for f in mine + golden if f.usable for note in f.data_notes]
    for side, path, option in ((mine, target_path, ""), (golden, baseline_path, "--baseline ")):
        if not any(f.usable for f in side):
            raise no_usable_file([f.reason for f in side], path, option)
    pairs = pair_files(mine, golden)
    notes += (same_file_notes(pairs) + rank_notes(mine, golden)
              + other_rank_notes(pairs, golden) + unpaired_notes(pairs, golden)
              + model_notes(pairs))
    used: set[int] = set()
    tasks = plan_baseline(pairs, thresholds, rules, used)
    notes += unused_rule_notes(rules, used)
    parts = scan(run_row_task, tasks, jobs, progress=_show(progress), desc="baseline")
    result = finish_baseline(target_path, baseline_path, mine, golden, thresholds, parts,
                                  same_device=_same_device(pairs))
    result.notes = notes
    return result


def _same_device(pairs) -> dict[tuple[str, str], bool]:
    """(source, golden source) -> True for the file pairs that ran on one device type, False
    where either file does not say (an msprobe dump); pairs of two device types are left out."""
    out = {}
    for m, g in pairs:
        if not (m.device and g.device):
            out[(m.source, g.source)] = False
        elif m.device == g.device:
            out[(m.source, g.source)] = True
    return out


def check_consistency(
    files: Sequence[str], root: str | None = None, *, thresholds: Thresholds | None = None,
    jobs: int = 1, progress: bool = False,
) -> ConsistencyResult | None:
    """Consistency of the dump ``files`` (paths), named relative to ``root``; None when no group
    of at least three sources shares a model and inputs."""
    import os

    jobs = check_jobs(jobs)
    try:
        found = [inspect(f, os.path.relpath(f, root) if root else f) for f in files]
        from .consistency import group_sources

        return _consistency(group_sources(found), thresholds, jobs, progress)
    finally:
        close_readers()


def _consistency(sources: list, thresholds: Thresholds | None, jobs: int,
                 show: bool) -> ConsistencyResult | None:
    """The check of the groups of sources (``consistency.group_sources``) of 3 or more."""
    from .consistency import finish as finish_consistency
    from .consistency import plan as plan_consistency
    from .consistency_task import run_task as run_consistency_task

    tasks, groups, tolerance = plan_consistency(sources, thresholds)
    if not groups:
        return None
    parts = scan(run_consistency_task, tasks, jobs, progress=show, desc="consistency")
    return finish_consistency(tasks, groups, tolerance, parts)


def _show(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress
