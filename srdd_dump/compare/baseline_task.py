"""Rows of the GPU-baseline table: the code that runs in the worker processes of
``srdd-compare --baseline -j N``. It imports no pandas and no report code, so a spawned worker
starts in 0.14 s of CPU instead of 0.5 s (with pandas and openpyxl)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..analysis.metrics import PairStats, SideStats
from ..analysis.summary_stats import from_side, from_stats, red_lower_bound
from ..analysis.tolerance import Thresholds, judge
from ..analysis.verdicts import FAIL, NOT_COMPARED, PASS, WARN
from ..errors import first_line
from ..format import schema as s
from ..format.blocks import block_rows, record_blocks, shape_of
from ..format.reader import DumpReader
from .readers import READ_ERRORS, open_reader
from .results import MD5_DIFFER

STATISTICS_ONLY = ("statistics only: element-wise metrics N/A; red_lower_bound is the "
                   "smallest relative error Max/Min/Mean/Norm prove")
TASK_ROWS = 256  # rows a task at most: the processes of -j N finish together


@dataclass
class RowSpec:
    """One row to produce: keys, the two records (indices into reader.records) and why not."""

    order: tuple
    keys: dict
    mine: tuple[int, ...]  # my records, concatenated along the last dimension (a fused site
    golden: tuple[int, ...]  # against its split parts); () when that side has none
    compare: bool
    reason: str = ""
    my_mask: int | None = None  # the round's KIND_MASK record: padded rows left out
    golden_mask: int | None = None
    # a side without a tensor: its row of /stats in a statistics-only file (msprobe statistics)
    my_summary: int | None = None
    golden_summary: int | None = None


@dataclass
class RowTask:
    my_path: str
    golden_path: str
    thresholds: Thresholds
    specs: list[RowSpec]


class Group:
    """The records of one side of a row: one, or the parts of a site whose counterpart is
    fused (read side by side, as one tensor concatenated along the last dimension)."""

    def __init__(self, reader: DumpReader, indices: tuple[int, ...]):
        self.reader = reader
        self.records = [reader.records[i] for i in indices]
        self.first = self.records[0]

    @property
    def dtype(self) -> str:
        return "/".join(dict.fromkeys(self.reader.dtype_of(r) for r in self.records))

    @property
    def shape(self) -> tuple[int, int, int]:
        batch, ntok, _ = shape_of(self.first)
        widths = [shape_of(r) for r in self.records]
        if any(w[:2] != (batch, ntok) for w in widths):
            return (-1, -1, -1)  # parts shaped unlike each other: never equal to the other side
        return batch, ntok, sum(w[2] for w in widths)

    @property
    def nrows(self) -> int:
        return int(self.first["nrows"])

    def blocks(self, rows: int | None = None) -> Iterator[np.ndarray]:
        """(rows, width) float arrays of the concatenated records, in order."""
        if len(self.records) == 1:
            yield from record_blocks(self.reader, self.first, rows)
            return
        rows = rows or block_rows(self.shape[2])
        parts = [record_blocks(self.reader, r, rows) for r in self.records]
        for blocks in zip(*parts):
            yield np.hstack(blocks)


def run_task(task: RowTask) -> list[dict]:
    out = []
    limits: dict = {}  # (golden dtype, my dtype) -> Limits, the same for every row
    for spec in task.specs:
        try:
            mine = _side(task.my_path, spec.mine, spec.my_summary)
            golden = _side(task.golden_path, spec.golden, spec.golden_summary)
            if isinstance(mine, Summary) or isinstance(golden, Summary):
                out.append(_compare_summaries(spec, mine, golden, task.thresholds))
            else:
                out.append(_compare_row(spec, mine, golden, task.thresholds, limits))
        except READ_ERRORS as exc:
            failed = RowSpec(spec.order, spec.keys, (), (), False,
                             f"read error: {first_line(exc)}")
            out.append(_compare_row(failed, None, None, task.thresholds))
    return out


class Summary:
    """One side known by its statistics only (a statistics-only file's /stats row)."""

    def __init__(self, reader: DumpReader, index: int):
        row = reader.stats_row(index)
        entry = reader.stats_index[index]
        self.dtype = s.DTYPE_CODES[int(entry["dtype"])]
        at = np.flatnonzero(reader.rounds["round"] == entry["round"])
        batch, ntok = ((int(reader.rounds["batch"][at[0]]), int(reader.rounds["ntok"][at[0]]))
                       if at.size else (0, 0))
        n = row.get("n", math.nan)
        nonfinite = int(row.get("nan", 0) or 0) + int(row.get("inf", 0) or 0)
        # an srdd stats dump counts the finite values of the rows that are not padding
        # (msprobe's n is every element, its nan and inf are flags)
        own = not reader.meta.get("statistics_only")
        elements = n + nonfinite if own else n
        rows = row.get("rows", math.nan) if own else math.nan
        self.padded = int(batch * ntok - rows) if math.isfinite(rows) else 0
        width = (int(elements) // (batch * ntok) if batch * ntok and math.isfinite(elements)
                 and not self.padded else -1)
        self.shape = (batch, ntok, width)
        self.checksum = row.get("checksum", math.nan)  # msprobe's md5 (NaN: none)
        self.summary = from_stats(n, row.get("max", math.nan), row.get("min", math.nan),
                                  row.get("mean", math.nan), row.get("norm", math.nan),
                                  m2=row.get("m2", math.nan), nonfinite=nonfinite,
                                  dtype=self.dtype)


def _side(path: str, records: tuple[int, ...], summary: int | None) -> Group | Summary | None:
    if records:
        return Group(open_reader(path), records)
    if summary is not None:
        return Summary(open_reader(path), summary)
    return None


def _compare_summaries(spec: RowSpec, mine: Group | Summary | None,
                       golden: Group | Summary | None, thresholds: Thresholds) -> dict:
    """A row with a statistics-only side: max, min, mean and norm on both sides and the
    relative error they prove (analysis.summary_stats); the element-wise metrics N/A."""
    row = dict(spec.keys, _order=spec.order, verdict=NOT_COMPARED, tolerance="")
    reasons = [spec.reason] if spec.reason else []
    sides = {}
    for prefix, side in (("golden", golden), ("my", mine)):
        if side is None:
            continue
        row[f"{prefix}_dtype"], row[f"{prefix}_shape"] = side.dtype, str(list(side.shape))
        sides[prefix] = side.summary if isinstance(side, Summary) else from_side(
            _side_stats(side))
    for prefix, summary in sides.items():
        row[f"{prefix}_max_value"], row[f"{prefix}_min_value"], row[f"{prefix}_mean_value"] = (
            summary.values())
        row[f"{prefix}_norm"] = summary.norm
        row[f"{prefix}_nan_inf"] = summary.nonfinite
    compare = spec.compare and len(sides) == 2
    padded = [p for p, side in (("my", mine), ("the golden", golden))
              if isinstance(side, Summary) and side.padded > 0]
    if compare and padded:
        reasons.append(f"{padded[0]} statistics leave out the padded rows, which the other "
                       "side's include")
        compare = False
    elif compare and mine.shape != golden.shape:
        reasons.append(f"shape mismatch: golden {row['golden_shape']} vs my {row['my_shape']}")
        compare = False
    if compare:
        limits = thresholds.limits(row["golden_dtype"].split("/")[0],
                                   row["my_dtype"].split("/")[0])
        bound = red_lower_bound(sides["my"], sides["golden"])
        bad = [p for p in ("golden", "my") if sides[p].nonfinite]
        verdict = PASS
        if len(bad) == 1:
            verdict = FAIL
            reasons.append(f"NaN/Inf on the {bad[0]} side only")
        elif bad:
            verdict = WARN
            reasons.append("NaN/Inf on both sides")
        elif math.isnan(bound):
            verdict = NOT_COMPARED
        elif bound > limits.rel_dist_fail:
            verdict = FAIL
        elif bound > limits.rel_dist_warn:
            verdict = WARN
        reasons.append(STATISTICS_ONLY)
        row.update(red_lower_bound=bound, verdict=verdict, tolerance=limits.tolerance)
        sums = [side.checksum for side in (mine, golden) if isinstance(side, Summary)]
        if len(sums) == 2 and all(math.isfinite(c) for c in sums) and not bad:
            if sums[0] == sums[1]:  # equal md5: equal bit for bit, an error of 0 measured
                row.update(relative_euclidean_distance=0.0, red_lower_bound=math.nan)
                reasons[-1] = "statistics only: the md5 of both sides agree (equal tensors)"
            else:
                reasons.append(MD5_DIFFER)
    row["cmp_fail_reason"] = "; ".join(r for r in reasons if r)
    return row


def _compare_row(
    spec: RowSpec, mine: Group | None, golden: Group | None, thresholds: Thresholds,
    limits_cache: dict | None = None,
) -> dict:
    row = dict(spec.keys, _order=spec.order, verdict=NOT_COMPARED, tolerance="")
    reasons = [spec.reason] if spec.reason else []
    for prefix, group in (("my", mine), ("golden", golden)):
        if group is not None:
            row[f"{prefix}_dtype"] = group.dtype
            row[f"{prefix}_shape"] = str(list(group.shape))
    compare = spec.compare and mine is not None and golden is not None
    sampled = None
    if compare and mine.shape != golden.shape:
        sampled = _sampled_pair(mine, golden)
        if isinstance(sampled, str):  # a stats dump's rows none of which the other kept
            reasons.append(sampled)
            compare, sampled = False, None
        elif sampled is not None:
            reasons.append(f"rows: the {len(sampled[0])} sampled rows of the stats dump")
        else:
            sampled, side, kept = _kept_pair(mine, golden, spec)
            if sampled is not None:
                reasons.append(f"rows: the {kept} token positions {side} dump kept "
                               "(--tokens)")
    if compare and sampled is None and mine.shape != golden.shape:
        reasons.append(
            f"shape mismatch: golden {row['golden_shape']} vs my {row['my_shape']}"
        )
        compare = False
    if compare:
        stats = PairStats(rules=thresholds.metrics)
        rows = block_rows(mine.shape[2])
        valid = _attended(spec, mine.reader, golden.reader, mine.nrows)
        start = 0
        pairs = zip(golden.blocks(rows), mine.blocks(rows))
        if sampled is not None:
            pairs, valid = [(sampled[1], sampled[0])], None
        for g, m in pairs:
            if valid is not None:  # rows the attention mask excludes (padding) are left out
                keep = valid[start: start + len(g)]
                start += len(g)
                g, m = g[keep], m[keep]
            stats.add(g, m)
        key = (row["golden_dtype"], row["my_dtype"])
        limits = None if limits_cache is None else limits_cache.get(key)
        if limits is None:
            limits = thresholds.limits(*(k.split("/")[0] for k in key))
            if limits_cache is not None:
                limits_cache[key] = limits
        verdict, why = judge(stats, limits)
        reasons += why
        if row["golden_dtype"] != row["my_dtype"]:
            reasons.append(
                f"dtypes differ: golden {row['golden_dtype']}, my {row['my_dtype']}"
            )
        row.update(stats.metrics(), verdict=verdict, tolerance=limits.tolerance)
        sides = (("golden", stats.golden), ("my", stats.mine))
    else:
        sides = tuple((prefix, _side_stats(group))
                      for prefix, group in (("golden", golden), ("my", mine))
                      if group is not None)
    for prefix, side in sides:
        row[f"{prefix}_max_value"], row[f"{prefix}_min_value"], row[f"{prefix}_mean_value"] = (
            side.values()
        )
        row[f"{prefix}_nan_inf"] = side.nonfinite
    row["cmp_fail_reason"] = "; ".join(r for r in reasons if r)
    return row


def _sampled_pair(mine: Group, golden: Group) -> tuple[np.ndarray, np.ndarray] | str | None:
    """(my rows, golden rows) when one side is a stats dump's row sample of a block output
    (``--store stats``) and the other holds every row of a round of the same sequences, or
    the rows of the token positions it kept (``--tokens``): the other side's same rows
    (those it kept). None when they cannot be paired; the reason when no sampled row was
    kept on the other side."""
    if len(mine.records) != 1 or len(golden.records) != 1:
        return None
    my_rec, golden_rec = mine.first, golden.first
    if bool(my_rec["subset"]) == bool(golden_rec["subset"]) or \
            int(my_rec["width"]) != int(golden_rec["width"]):
        return None
    sides = [(mine.reader, my_rec), (golden.reader, golden_rec)]
    (s_reader, s_rec), (f_reader, f_rec) = sides if my_rec["subset"] else sides[::-1]
    s_round, f_round = _round_row(s_reader, s_rec), _round_row(f_reader, f_rec)
    if s_round is None or f_round is None or int(s_round["batch"]) != int(f_round["batch"]):
        return None
    rows = s_reader.probe_rows(s_round)
    width = int(s_rec["width"])
    if rows.size != int(s_rec["nrows"]) or int(f_rec["nrows"]) != \
            int(f_round["batch"]) * int(f_round["ntok"]):
        return None
    sample = s_reader.read(s_rec).reshape(-1, width)
    full = f_reader.read(f_rec).reshape(-1, width)
    if int(s_round["ntok"]) != int(f_round["ntok"]):  # the full side kept some positions
        at = _rows_at(rows, s_reader.positions(s_round), f_reader.positions(f_round))
        if at is None:
            return None
        if not (at >= 0).any():
            side = "my" if my_rec["subset"] else "the golden"
            return (f"no sampled row kept: none of the {rows.size} sampled rows of {side} "
                    "stats dump is at a token position the other dump kept (--tokens)")
        sample, rows = sample[at >= 0], at[at >= 0]
    full = full[rows]
    return (sample, full) if my_rec["subset"] else (full, sample)


def _rows_at(rows: np.ndarray, positions: np.ndarray, kept: np.ndarray) -> np.ndarray | None:
    """For each of ``rows`` (of a round of ``positions`` per sequence), the row of a round
    that kept the positions ``kept`` of the same sequences holding its token, -1 where that
    position was not kept; None when the positions do not nest."""
    where = {int(p): k for k, p in enumerate(kept)}
    if len(where) != len(kept) or not set(where) <= {int(p) for p in positions}:
        return None
    seq, col = np.divmod(rows, len(positions))
    at = np.array([where.get(int(positions[c]), -1) for c in col], dtype=np.int64)
    return np.where(at >= 0, seq * len(kept) + at, -1)


def _kept_pair(mine: Group, golden: Group, spec: RowSpec
               ) -> tuple[tuple[np.ndarray, np.ndarray] | None, str, int]:
    """((my rows, golden rows), "my" or "the golden", positions kept) when one side kept
    fewer token positions of the same round (``--tokens -8:`` against a whole dump) and the
    other holds them all, in order: the other side's rows at those positions, rows either
    side's attention mask excludes (padding) left out. (None, "", 0) when they cannot be
    paired."""
    none = None, "", 0
    if len(mine.records) != 1 or len(golden.records) != 1:
        return none
    recs = (mine.first, golden.first)
    if any(bool(r["subset"]) for r in recs) or int(recs[0]["width"]) != int(recs[1]["width"]):
        return none
    rounds = [_round_row(g.reader, r) for g, r in zip((mine, golden), recs)]
    if any(r is None for r in rounds) or int(rounds[0]["batch"]) != int(rounds[1]["batch"]):
        return none
    kept = [g.reader.positions(r) for g, r in zip((mine, golden), rounds)]
    if any(int(r["nrows"]) != int(rd["batch"]) * len(k)
           for r, rd, k in zip(recs, rounds, kept)) or len(kept[0]) == len(kept[1]):
        return none
    few, many = (0, 1) if len(kept[0]) < len(kept[1]) else (1, 0)
    if not (np.diff(kept[many]) > 0).all():  # the whole side's positions, in order
        return none
    at = np.searchsorted(kept[many], kept[few])
    if (at >= len(kept[many])).any() or (kept[many][np.minimum(at, len(kept[many]) - 1)]
                                         != kept[few]).any():
        return none
    width = int(recs[0]["width"])
    rows = (np.arange(int(rounds[0]["batch"]))[:, None] * len(kept[many]) + at).reshape(-1)
    sides = [g.reader.read(r).reshape(-1, width) for g, r in zip((mine, golden), recs)]
    sides[many] = sides[many][rows]
    valid = np.ones(len(rows), dtype=bool)
    for k, (group, index) in enumerate(((mine, spec.my_mask), (golden, spec.golden_mask))):
        if index is not None:
            keep = _mask_rows(group.reader, index)
            if k == many and keep.size == int(rounds[many]["batch"]) * len(kept[many]):
                keep = keep[rows]  # the whole side's mask at the positions paired
            if keep.size != len(rows):
                return none
            valid &= keep
    if not valid.any():
        return none
    return ((sides[0][valid], sides[1][valid]), "my" if few == 0 else "the golden",
            len(kept[few]))


def _round_row(reader: DumpReader, record: np.void) -> np.void | None:
    at = np.flatnonzero(reader.rounds["round"] == record["round"])
    return reader.rounds[at[0]] if at.size else None


def _attended(spec: RowSpec, mine: DumpReader, golden: DumpReader, nrows: int
              ) -> np.ndarray | None:
    """Rows attended on both sides (None: every row), from the rounds' mask records."""
    valid = None
    for reader, index in ((mine, spec.my_mask), (golden, spec.golden_mask)):
        if index is None:
            continue
        keep = _mask_rows(reader, index)
        if keep.size == nrows:
            valid = keep if valid is None else valid & keep
    return None if valid is None or valid.all() else valid


def _mask_rows(reader: DumpReader, index: int) -> np.ndarray:
    """The rows a round's KIND_MASK record keeps (attended), flattened."""
    return reader.read(reader.records[index]).reshape(-1) != 0


def _side_stats(group: Group) -> SideStats:
    side = SideStats()
    for block in group.blocks():
        side.add_raw(block)
    return side
