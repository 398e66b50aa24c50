"""The consistency check of one layer of one group: the code that runs in worker processes (no
pandas, no report code)."""

from __future__ import annotations

from dataclasses import dataclass

from ..analysis.consistency import LayerConsistency
from ..format.blocks import block_rows, record_blocks, shape_of
from .readers import READ_ERRORS, open_reader


@dataclass
class ConsistencyTask:
    """One layer of one group: per common round, one record index per source (-1: none)."""

    group: int
    layer: int
    paths: list[str]
    records: list[list[int]]  # per common round, one record index per source
    tolerance: float
    floor: float


def run_task(task: ConsistencyTask) -> tuple[list[dict], int, int]:
    """Accumulate one layer of one group over its common rounds: (per-source results,
    rounds used, rounds skipped)."""
    try:
        return _accumulate(task)
    except READ_ERRORS:  # a damaged file: this layer is left out of the check, not the report
        return [], 0, len(task.records)


def _accumulate(task: ConsistencyTask) -> tuple[list[dict], int, int]:
    readers = [open_reader(p) for p in task.paths]
    acc = LayerConsistency(len(readers))
    skipped = 0
    for recs in task.records:
        if min(recs) < 0:
            skipped += 1
            continue
        records = [r.records[i] for r, i in zip(readers, recs)]
        if len({shape_of(x) for x in records}) != 1:
            skipped += 1
            continue
        rows = block_rows(int(records[0]["width"]) * len(records))
        streams = [record_blocks(r, x, rows) for r, x in zip(readers, records)]
        for blocks in zip(*streams):
            acc.add(list(blocks))
        acc.rounds += 1
    return acc.results(task.tolerance, task.floor), acc.rounds, skipped
