"""GPU-baseline mode: compare my dumps (e.g. from an NPU) layer by layer with golden dumps.

Files are paired (by rank, else in order; one golden file serves every file of mine), then
samples (by input hash, then order), rounds (same step) and layers (module name, then index).
Each task computes msit's metrics and more for up to TASK_ROWS pairs of clean block-output
records of one file pair and layer (``baseline_task``); the rows are judged one by one
(analysis.tolerance) and the run as a whole (``divergence``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..analysis.matching import DIFFER, RoundPair, pair_layers, pair_rounds
from ..analysis.metrics import METRIC_NAMES
from ..analysis.site_names import SitePair, SitePairing, SiteRule, pair_sites
from ..analysis.tolerance import Thresholds
from ..format import schema as s
from ..format.blocks import first_rows
from ..format.layer_numbers import layer_numbers, number_of
from ..vocabulary import EXPERT, EXPERT_SLOTS
from .baseline_task import TASK_ROWS, RowSpec, RowTask
from .divergence import mark_divergence, mark_site_birth, mark_sites, summarize
from .other_tokens import drifted_rounds, said, set_aside, set_aside_rounds
from .results import (
    BASELINE_COLUMNS,
    BASELINE_FILE_COLUMNS,
    DERIVED_COLUMNS,
    INCOMPLETE,
    SITE_BASELINE_COLUMNS,
    SITE_DERIVED_COLUMNS,
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
            if f.usable and f.summary_rows:
                pass  # statistics only: compared by its statistics
            elif f.usable and not f.clean_blocks and f.stats_index is not None:
                f.status, f.reason = SKIPPED, (
                    f"{f.source}: a stats dump without rows (--store stats:0); the baseline mode "
                    "compares tensors: dump with --store stats (2 rows of each block), "
                    "sample:N or full")
            elif f.usable and not f.clean_blocks and not f.clean_sites:
                f.status, f.reason = SKIPPED, f"{f.source}: no captured layer data"
            elif f.status == INCOMPLETE:
                f.reason = f"{f.source}: capture did not finish; rounds written used"
            rows.append(Side(f, role))
        sides.append(rows)
    # a stats dump opposite a statistics-only file: compared by its whole outputs' moments
    for these, others in ((sides[0], sides[1]), (sides[1], sides[0])):
        if any(f.usable and f.summary_rows for f in others):
            for f in these:
                if f.usable and f.stats_index is not None and not f.summary_rows:
                    f.whole_rows = first_rows(f.rounds, f.stats_index,
                                              np.ones(len(f.stats_index), dtype=bool),
                                              ("round", "layer", "site"))
    return sides[0], sides[1]


def unused_rule_notes(rules: tuple[SiteRule, ...], used: set[int]) -> list[str]:
    """One line per --mapping rule that paired no sites (a name misspelt, or not dumped)."""
    return [f"--mapping: '{' + '.join(r.mine)}: {' + '.join(r.golden)}' paired no sites (no "
            "paired block holds both sides' names)" for i, r in enumerate(rules) if i not in used]


def store_notes(sides: list[Side]) -> list[str]:
    """One line per stats dump compared: its rows are a seeded sample, not every token."""
    out = []
    for f in sides:
        if not f.usable or f.stats_index is None:
            continue
        if f.summary_rows:
            out.append(f"{f.source}: statistics only (msprobe task statistics: Max, Min, Mean, "
                       "Norm per tensor): its rows give max/min/mean and the norms; cosine, the "
                       "relative and absolute errors, KL and the error ratios are N/A, and the "
                       "verdicts rest on red_lower_bound, the smallest relative error those "
                       "statistics prove (an error that keeps them is not seen)")
        elif any(other.usable and other.summary_rows for other in sides):
            out.append(f"{f.source}: a stats dump (--store stats) against statistics only: "
                       "its block outputs are compared by their whole statistics (count, mean, "
                       "norm) where both count the same elements (padding: not compared)")
        else:
            out.append(f"{f.source}: a stats dump (--store stats): the baseline compares the "
                       "seeded rows of each block output it kept, not every token (for every "
                       "row: --store sample:N or full)")
    return out


def finish(path: str, baseline: str, mine: list[Side], golden: list[Side],
           thresholds: Thresholds, parts: list[list[dict]],
           same_device: dict[tuple[str, str], bool] | None = None) -> BaselineResult:
    """``same_device``: (source, golden source) -> whether they ran on one device type (True)
    or either file does not say (False: divergence._same_setup), where a non-zero error from
    an exactly equal input is the birth of an error."""
    rows = [row for part in parts for row in part]
    _number_layers(rows, mine, golden)
    table = _table([r for r in rows if not r.get("_site")], same_device, drift=True)
    sites = site_table([r for r in rows if r.get("_site")], table, same_device)
    files = pd.DataFrame([_file_row(f) for f in mine + golden], columns=BASELINE_FILE_COLUMNS)
    for col in ("rounds", "samples", "layers", "rank", "pid"):
        files[col] = files[col].astype("Int64")
    summary = summarize(table, same_device, sites)
    mark_site_birth(summary, table, sites)
    summary.message += said(table)
    return BaselineResult(path=path, baseline=baseline, table=table, files=files,
                          summary=summary, thresholds=thresholds, sites=sites)


def _number_layers(rows: list[dict], mine: list[Side], golden: list[Side]) -> None:
    """The rows' ``layer`` and ``golden_layer``: the model's layer numbers, not the files'
    positions (a dump of some blocks: format.layer_numbers)."""
    sides = (("layer", "source", {f.source: layer_numbers(f.layers) for f in mine}),
             ("golden_layer", "golden_source", {f.source: layer_numbers(f.layers) for f in golden}))
    for row in rows:
        for key, source, numbers in sides:
            at = numbers.get(row.get(source))
            if at is not None and row.get(key) is not None:
                row[key] = number_of(at, row[key])


# -- files -------------------------------------------------------------------------------------


def pair_files(mine: list[Side], golden: list[Side]) -> list[tuple[Side, Side]]:
    """Each of my files with a golden file: the only one, else the golden file of its rank,
    else (no rank, or several golden files of it) the one whose rounds share the most inputs
    with it (their token ids' hashes), then the first not yet paired. A golden file serves
    every file of mine that picks it (two runs of mine in one folder: both compared)."""
    my_ok = [f for f in mine if f.usable]
    golden_ok = [f for f in golden if f.usable]
    pairs: list[tuple[Side, Side]] = []
    for f in my_ok:
        same_rank = [g for g in golden_ok if f.rank is not None and g.rank == f.rank]
        candidates = same_rank or golden_ok
        if not candidates:
            f.file.status = SKIPPED
            f.file.reason = f"{f.source}: no golden dump file to pair with"
            continue
        taken = {id(g) for _, g in pairs}
        shared = [_shared_inputs(f, g) for g in candidates]
        best = max(shared)
        tied = [g for g, n in zip(candidates, shared) if n == best]
        pick = next((g for g in tied if id(g) not in taken), tied[0])
        pairs.append((f, pick))
    paired = {id(g) for _, g in pairs}
    for g in golden_ok:
        if id(g) not in paired:
            g.file.reason = g.reason or f"{g.source}: no dump file of mine to pair with"
    for f, g in pairs:
        f.paired_with = g.source
        g.paired_with = ", ".join(x for x in (g.paired_with, f.source) if x)
    return pairs


def _shared_inputs(mine: Side, golden: Side) -> int:
    """The prompts (prefill rounds' input hashes, known ones) the two files have in common: a
    decode step's one token matches another run's by chance."""
    a, b = (set(int(r["tokens_hash"]) for r in f.rounds if int(r["tokens_hash"])
                and int(r["step"]) == 0) for f in (mine, golden))
    return len(a & b)


def unpaired_notes(pairs: list[tuple[Side, Side]], golden: list[Side]) -> list[str]:
    """A line for the golden files no file of mine paired with (a rank not in my dumps, a
    second run of a rank): the finding covers the others only."""
    picked = {id(g) for _, g in pairs}
    left = [g.source + (f" (rank {g.rank})" if g.rank is not None else "")
            for g in golden if g.usable and id(g) not in picked]
    return [f"golden file{'s' if len(left) > 1 else ''} {', '.join(left)} paired with no file "
            "of mine: not compared"] if left and pairs else []


def same_file_notes(pairs: list[tuple[Side, Side]]) -> list[str]:
    """One line when my files are the golden ones themselves (the same folder given twice):
    every layer agrees by construction, whatever the port does."""
    same = [f.source for f, g in pairs
            if os.path.realpath(f.file.path) == os.path.realpath(g.file.path)]
    if not same or len(same) < len(pairs):
        return []
    return [f"my dumps and the golden ones are the same file{'s' if len(same) > 1 else ''} "
            f"({', '.join(same[:3])}{', ...' if len(same) > 3 else ''}): every layer agrees "
            "by construction; give --baseline the golden run's dumps"]


def other_rank_notes(pairs: list[tuple[Side, Side]], golden: list[Side]) -> list[str]:
    """A line for my files paired with a golden file of another rank, where the golden side
    has several ranks (its rank's file is missing there): a data-parallel rank's inputs are
    another rank's only by chance. (One golden file serving every rank is the usual case.)"""
    if len({g.rank for g in golden if g.usable}) < 2:
        return []
    crossed = [f"{f.source} (rank {f.rank}) with {g.source} (rank {g.rank})" for f, g in pairs
               if f.rank is not None and g.rank is not None and f.rank != g.rank]
    return [f"the golden dumps hold no file of my rank for: {'; '.join(crossed)} (compared "
            "with the golden file sharing the most prompts; copy that rank's golden file if "
            "the run has one)"] if crossed else []


def rank_notes(mine: list[Side], golden: list[Side]) -> list[str]:
    """A line for a side holding more than one file of a rank (the files of two runs in one
    folder: code writes its dumps into the dump path itself), saying how they were paired."""
    out = []
    for side, who, how in ((mine, "my dumps hold", "each is compared with the golden file of "
                            "its rank"),
                           (golden, "the golden dumps hold", "each of mine is compared with "
                            "the one of its rank sharing the most inputs with it")):
        by_rank: dict[int, list[str]] = {}
        for f in side:
            if f.usable and f.rank is not None:
                by_rank.setdefault(int(f.rank), []).append(f.source)
        twice = [f"rank {rank}: {', '.join(sources)}" for rank, sources in sorted(by_rank.items())
                 if len(sources) > 1]
        if twice:
            out.append(f"{who} more than one file of a rank ({'; '.join(twice)}): two runs in "
                       f"one folder? {how}")
    return out


def model_notes(pairs: list[tuple[Side, Side]]) -> list[str]:
    """One line when paired files are dumps of two models: their configs' model types (else
    their classes' names) or layer counts differ, where both files say them. Their rows still
    pair by layer number."""
    differ = {(_model_words(m), _model_words(g)) for m, g in pairs if _two_models(m, g)}
    if not differ:
        return []
    mine, golden = sorted(differ)[0]
    more = f" (and {len(differ) - 1} other pairs)" if len(differ) > 1 else ""
    return [f"the dumps are of two models: {mine} here, {golden} in the golden run{more}; "
            "their rows pair by layer number, so their differences are the models' and not "
            "only the device's"]


def _two_models(m: Side, g: Side) -> bool:
    if m.model_layers and g.model_layers and m.model_layers != g.model_layers:
        return True
    if m.model_type and g.model_type:  # a wrapper class (PEFT, vLLM's) keeps its config's
        return m.model_type != g.model_type
    return bool(m.model_class and g.model_class and _class_name(m) != _class_name(g))


def _class_name(f: Side) -> str:
    return f.model_class.rsplit(".", 1)[-1]


def _model_words(f: Side) -> str:
    layers = f" of {f.model_layers} layers" if f.model_layers else ""
    kind = f" ({f.model_type})" if f.model_type else ""
    return f"{_class_name(f) or 'a model'}{kind}{layers}"


def _file_row(f: Side) -> dict:
    rounds = f.rounds
    return {
        "role": f.role, "source": f.source, "status": f.status, "reason": f.reason,
        "paired_with": f.paired_with, "rounds": len(rounds),
        "samples": len(np.unique(rounds["sample"])), "layers": len(f.layers),
        "rank": f.rank, "pid": f.pid,
    }


# -- planning ----------------------------------------------------------------------------------


def plan(pairs: list[tuple[Side, Side]], thresholds: Thresholds,
         rules: tuple[SiteRule, ...] = (), rules_used: set[int] | None = None
         ) -> list[RowTask]:
    """Row specs grouped into tasks of one (file pair, layer pair) each: the block rows, and
    the rows of the sub-layers and operators of the paired blocks (``rules``: a mapping
    file's, see analysis.site_names; the indices of those that paired some sites are added
    to ``rules_used``)."""
    tasks: dict[tuple, RowTask] = {}
    for p, (mine, golden) in enumerate(pairs):
        layer_pairs = _with_stack_input(mine, golden, pair_layers(mine.layers, golden.layers))
        sites = SitePlan(mine, golden, layer_pairs, rules)
        if rules_used is not None:
            rules_used.update(*(p.rules_used for p in sites.pairing.values()))
        for spec in sites.unmatched_specs(p):
            tasks.setdefault((p, "unmatched"), RowTask(mine.path, golden.path, thresholds, []))
            tasks[(p, "unmatched")].specs.append(spec)
        for r, rp in enumerate(pair_rounds(mine.rounds, golden.rounds,
                                            (mine.histories, golden.histories))):
            base = {
                "source": mine.source, "golden_source": golden.source, "sample": rp.sample,
                "golden_sample": rp.golden_sample, "step": rp.step, "input_match": rp.input_match,
            }
            if rp.round is None or rp.golden_round is None:
                keys = dict(base, layer=None, module="", golden_layer=None, golden_module="")
                spec = RowSpec((p, r, -2), keys, (), (), False, rp.reason)
                tasks.setdefault((p, "rounds"), RowTask(mine.path, golden.path, thresholds, []))
                tasks[(p, "rounds")].specs.append(spec)
                continue
            for k, (i, j) in enumerate(layer_pairs):
                spec = _layer_spec(mine, golden, rp, i, j, base)
                spec.order = (p, r, k)
                key = (p, i, j)
                tasks.setdefault(key, RowTask(mine.path, golden.path, thresholds, []))
                tasks[key].specs.append(spec)
                for spec in sites.specs(rp, i, j, base, (p, r, k)):
                    key = (p, "sites", i, j)
                    tasks.setdefault(key, RowTask(mine.path, golden.path, thresholds, []))
                    tasks[key].specs.append(spec)
    # at most TASK_ROWS rows a task: the processes of -j N finish together
    return [RowTask(task.my_path, task.golden_path, task.thresholds, task.specs[i: i + TASK_ROWS])
            for task in tasks.values() for i in range(0, len(task.specs), TASK_ROWS)]


class SitePlan:
    """The sub-layer and operator sites of each paired block, paired across the two dumps."""

    def __init__(self, mine: Side, golden: Side, layer_pairs: list, rules: tuple[SiteRule, ...]):
        self.mine, self.golden = mine, golden
        self.pairing: dict[tuple[int, int], SitePairing] = {}
        my_sites, golden_sites = _sites_by_layer(mine), _sites_by_layer(golden)
        self.order = _completion_order(mine)  # my sites in the order their outputs were made
        golden_order = _completion_order(golden)
        for i, j in layer_pairs:
            if i is None or j is None or i < 0 or j < 0:
                continue
            a, b = my_sites.get(i, {}), golden_sites.get(j, {})
            if a or b:
                self.pairing[(i, j)] = pair_sites(a, b, mine.module(i), golden.module(j), rules)
        far = len(self.order)
        self.order.update({("golden", k): far + v for k, v in golden_order.items()})

    def specs(self, rp: RoundPair, i: int | None, j: int | None, base: dict, order: tuple
              ) -> list[RowSpec]:
        pairing = self.pairing.get((i, j))
        if pairing is None or rp.round is None or rp.golden_round is None:
            return []
        out = []
        for pair in pairing.pairs:
            mine = [self.mine.clean_sites.get((rp.round, k)) for k in pair.mine]
            golden = [self.golden.clean_sites.get((rp.golden_round, k)) for k in pair.golden]
            my_recs = None if None in mine else tuple(mine)
            golden_recs = None if None in golden else tuple(golden)
            my_sum = golden_sum = None
            if my_recs is None and len(pair.mine) == 1:
                my_sum = _summary(self.mine, rp.round, i, pair.mine[0])
            if golden_recs is None and len(pair.golden) == 1:
                golden_sum = _summary(self.golden, rp.golden_round, j, pair.golden[0])
            reason = _why_not(rp, my_recs or my_sum, golden_recs or golden_sum, "site")
            keys = dict(base, layer=i, module=self._names(self.mine, pair.mine), golden_layer=j,
                        golden_module=self._names(self.golden, pair.golden),
                        matched_by=pair.how, _site=True)
            out.append(RowSpec((*order, self._rank(pair)), keys, my_recs or (),
                               golden_recs or (), not reason, reason,
                               my_mask=self.mine.masks.get(rp.round),
                               golden_mask=self.golden.masks.get(rp.golden_round),
                               my_summary=my_sum, golden_summary=golden_sum))
        return out

    def unmatched_specs(self, p: int) -> list[RowSpec]:
        """One row per site of a paired block that pairs with nothing on the other side."""
        out = []
        for (i, j), pairing in self.pairing.items():
            for side, sites, other in (("my", pairing.my_unmatched, "the golden dump"),
                                       ("golden", pairing.golden_unmatched, "my dump")):
                f = self.mine if side == "my" else self.golden
                for k in sites:
                    name = f.sites[k]
                    keys = dict(source=self.mine.source, golden_source=self.golden.source,
                                sample=None, golden_sample=None, step=None, input_match="",
                                layer=i, golden_layer=j, module=name if side == "my" else "",
                                golden_module=name if side == "golden" else "",
                                matched_by="", _site=True)
                    holder = self.golden if side == "my" else self.mine
                    if holder.stats_index is not None and name in holder.sites:
                        reason = (f"no counterpart: {side} site {name} has none in {other}: a "
                                  "stats dump (--store stats) keeps rows of its block outputs "
                                  "only")
                    else:
                        reason = (f"no counterpart: {side} site {name} has none in {other} "
                                  "(no name, alias, fused projection or --mapping rule pairs it)")
                    rank = self.order.get(k if side == "my" else ("golden", k), 0)
                    out.append(RowSpec((p, 1 << 30, i if i is not None else -1, rank), keys,
                                       (), (), False, reason))
        return out

    def _rank(self, pair: SitePair) -> int:
        ranks = [self.order[k] for k in pair.mine if k in self.order]
        ranks += [self.order[("golden", k)] for k in pair.golden if ("golden", k) in self.order]
        return min(ranks, default=0)

    @staticmethod
    def _names(f: Side, sites: tuple[int, ...]) -> str:
        return " + ".join(f.sites[k] if 0 <= k < len(f.sites) else str(k) for k in sites)


def _sites_by_layer(f: Side) -> dict[int, dict[int, str]]:
    """layer -> {site: module name} of the sites with clean output records."""
    out: dict[int, dict[int, str]] = {}
    for site, layer in f.site_layers.items():
        if 0 <= site < len(f.sites) and _compared_role(f, site):
            out.setdefault(layer, {})[site] = f.sites[site]
    return out


def _compared_role(f: Side, site: int) -> bool:
    """Sites whose output is one tensor shaped like the block's (the sites of single experts
    and of their token slots are shaped by routing: compared through the experts module)."""
    role = f.site_roles[site] if site < len(f.site_roles) else ""
    return role not in (EXPERT, EXPERT_SLOTS)


def _completion_order(f: Side) -> dict:
    """site -> its rank in the order the outputs were made (the records' order)."""
    first: dict[int, int] = {}
    for (_, site), index in f.clean_sites.items():
        if index < first.get(site, 1 << 62):
            first[site] = index
    return {site: rank for rank, site in enumerate(sorted(first, key=first.__getitem__))}


def _has_layer(f: Side, layer: int) -> bool:
    """The file holds that block's output: a tensor, or statistics only."""
    return (any(k[1] == layer for k in f.clean_blocks)
            or any(k[1] == layer and k[2] == s.BLOCK_SITE for k in f.summary_rows))


def _with_stack_input(mine: Side, golden: Side, pairs: list[tuple[int | None, int | None]]
                      ) -> list[tuple[int | None, int | None]]:
    """The layer pairs with the stack input (the hidden-state input of a dump's first block)
    first. Both dumps start at the same block: their stack inputs pair. One starts later (a
    dump of some layers, ``--layers``): its stack input is the output of the other's block
    before that one, so those pair; the earlier dump's own stack input pairs with nothing.
    Stacks named apart that start at the same layer number (their blocks pair in order): the
    stack inputs too. Dumps whose first blocks are other blocks: no stack input row (it would
    compare the inputs of two different blocks)."""
    has_mine, has_golden = _has_layer(mine, s.STACK_INPUT), _has_layer(golden, s.STACK_INPUT)
    if not (has_mine or has_golden):
        return pairs
    first_mine = mine.layers[0] if mine.layers else ""
    first_golden = golden.layers[0] if golden.layers else ""
    if first_mine == first_golden or not (first_mine and first_golden):
        return [(s.STACK_INPUT, s.STACK_INPUT)] + pairs
    if has_mine and first_mine in golden.layers[1:]:
        before = golden.layers.index(first_mine) - 1
        alone = [(None, s.STACK_INPUT)] if has_golden else []  # a row that says so
        return alone + [(s.STACK_INPUT, before)] + [p for p in pairs if p != (None, before)]
    if has_golden and first_golden in mine.layers[1:]:
        before = mine.layers.index(first_golden) - 1
        alone = [(s.STACK_INPUT, None)] if has_mine else []
        return alone + [(before, s.STACK_INPUT)] + [p for p in pairs if p != (before, None)]
    if (not set(mine.layers) & set(golden.layers)  # stacks named apart, from the same layer
            and layer_numbers(mine.layers)[0] == layer_numbers(golden.layers)[0]):
        return [(s.STACK_INPUT, s.STACK_INPUT)] + pairs
    return pairs


def _layer_spec(
    mine: Side, golden: Side, rp: RoundPair, i: int | None, j: int | None, base: dict
) -> RowSpec:
    keys = dict(
        base, layer=i, module=mine.module(i), golden_layer=j, golden_module=golden.module(j)
    )
    my_rec = mine.clean_blocks.get((rp.round, i)) if i is not None else None
    golden_rec = golden.clean_blocks.get((rp.golden_round, j)) if j is not None else None
    my_sum = _summary(mine, rp.round, i, s.BLOCK_SITE) if my_rec is None else None
    golden_sum = _summary(golden, rp.golden_round, j, s.BLOCK_SITE) if golden_rec is None else None
    if golden_sum is not None and my_rec is not None:  # statistics only opposite a record
        my_rec, my_sum = _whole_instead(mine, my_rec, rp.round, i)
    elif my_sum is not None and golden_rec is not None:
        golden_rec, golden_sum = _whole_instead(golden, golden_rec, rp.golden_round, j)
    if i is None and j == s.STACK_INPUT:
        reason = ("no counterpart: the golden stack input is the input of its first block, "
                  "which my dump starts after")
    elif j is None and i == s.STACK_INPUT:
        reason = ("no counterpart: my stack input is the input of my first block, which the "
                  "golden dump starts after")
    elif i is None:
        reason = (f"no counterpart: golden layer {number_of(layer_numbers(golden.layers), j)} "
                  f"({keys['golden_module']}) is not in my dump")
    elif j is None:
        reason = (f"no counterpart: my layer {number_of(layer_numbers(mine.layers), i)} "
                  f"({keys['module']}) is not in the golden dump")
    else:
        reason = _why_not(rp, _either(my_rec, my_sum), _either(golden_rec, golden_sum))
    return RowSpec((), keys, _records(my_rec), _records(golden_rec), not reason, reason,
                   my_mask=mine.masks.get(rp.round), golden_mask=golden.masks.get(rp.golden_round),
                   my_summary=my_sum, golden_summary=golden_sum)


def _summary(f: Side, round_: int | None, layer: int | None, site: int) -> int | None:
    """The /stats row of an output a statistics-only file has no tensor of."""
    if round_ is None or layer is None or not f.summary_rows:
        return None
    return f.summary_rows.get((round_, layer, site))


def _whole_instead(f: Side, record: int, round_: int | None, layer: int | None
                   ) -> tuple[int | None, int | None]:
    """(record, /stats row) of a block output opposite a statistics-only side: a stats dump's
    seeded rows give way to its whole output's statistics row, where it has one."""
    if not f.whole_rows or not f.records["subset"][record]:
        return record, None
    whole = f.whole_rows.get((round_, layer, s.BLOCK_SITE))
    return (record, None) if whole is None else (None, whole)


def _either(record: int | None, summary: int | None) -> int | None:
    return record if record is not None else summary


def _why_not(rp: RoundPair, my_rec, golden_rec, what: str = "layer") -> str:
    """Why a row of paired layers or sites is not compared ("" when it is)."""
    if my_rec is None or golden_rec is None:
        side = "my" if my_rec is None else "golden"
        return f"missing record: no {side} data for this {what} in this round"
    if rp.input_match == DIFFER:
        if rp.reason.startswith("prompts of other lengths"):
            return f"inputs differ: {rp.reason}, so the tensors are not compared"
        how = f", {rp.reason}" if rp.reason else ""
        return (f"inputs differ{how}: the input ids of this round (or an earlier one of the "
                "sample) are not those of the golden run, so the tensors are not compared")
    return ""


def _records(index: int | None) -> tuple[int, ...]:
    return () if index is None else (index,)


# -- the table ---------------------------------------------------------------------------------


def _table(rows: list[dict], same_device: dict[tuple[str, str], bool] | None = None,
           drift: bool = False) -> pd.DataFrame:
    """The block rows; ``drift``: the rounds whose generation likely drifted to other tokens
    are not judged (other_tokens.py; not for the cards of one run, which share inputs)."""
    columns = [c for c in BASELINE_COLUMNS if c not in DERIVED_COLUMNS]
    df = _typed(rows, columns)
    if drift:
        df = set_aside(df, drifted_rounds(df))
    df = mark_divergence(df, same_device)
    return df[BASELINE_COLUMNS].reset_index(drop=True)


def site_table(rows: list[dict], table: pd.DataFrame,
               same_device: dict[tuple[str, str], bool] | None = None) -> pd.DataFrame:
    """SITE_BASELINE_COLUMNS, in (source, sample, step, layer, completion) order, with the
    error growth of each site over its block's input and the birth site of each birth
    layer (divergence.mark_sites); the sites of the rounds the block table set aside
    (other_tokens.py) likewise."""
    columns = [c for c in SITE_BASELINE_COLUMNS if c not in SITE_DERIVED_COLUMNS]
    df = _typed(rows, columns)
    df["matched_by"] = df["matched_by"].astype(object).where(df["matched_by"].notna(), "")
    df = mark_sites(set_aside(df, set_aside_rounds(table)), table, same_device)
    return df[SITE_BASELINE_COLUMNS].reset_index(drop=True)


def _typed(rows: list[dict], columns: list[str]) -> pd.DataFrame:
    rows = sorted(rows, key=lambda r: r["_order"])
    df = pd.DataFrame(rows, columns=columns)
    for col in ("sample", "golden_sample", "step", "layer", "golden_layer", "golden_nan_inf",
                "my_nan_inf"):
        df[col] = df[col].astype("Int64")
    for col in (*METRIC_NAMES, "golden_max_value", "golden_min_value", "golden_mean_value",
                "my_max_value", "my_min_value", "my_mean_value", "golden_norm", "my_norm",
                "red_lower_bound"):
        df[col] = df[col].astype(float)
    for col in ("module", "golden_module", "input_match", "golden_dtype", "golden_shape",
                "my_dtype", "my_shape", "cmp_fail_reason", "tolerance"):
        df[col] = df[col].astype(object).where(df[col].notna(), "").astype(str)
    return df

