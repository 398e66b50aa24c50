"""Read the records of a dump file round by round into per-layer signals.

One HDF5 read per data set covers the records of many layers of a round (in groups of at most
``SPAN_BYTES``), so memory stays bounded whatever the dump's size. The arrays go to
``analysis.signals.LayerSignals``; ``chunks`` splits a file's layers into tasks of similar size.
A worker process runs ``run_task`` only: no pandas, no report code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..analysis.experts import expert_rows, split_route
from ..analysis.row_stats import one_row_stats
from ..analysis.signals import DECODE, LayerSignals, Probe, Signals
from ..errors import first_line
from ..format import schema as s
from ..format.layer_numbers import after_gap, layer_numbers
from ..format.reader import DumpReader
from ..vocabulary import EXPERT, SUBLAYER
from .readers import READ_ERRORS, open_reader
from .stats_rows import StatsLayout

SPAN_BYTES = 16 << 20  # data read at once: the records of a group of layers of one round
# the statistics of what a block adds (its output less its input: Signals.update_rms)
UPDATE_FIELDS = ("update_rms", "offset", "offset_noise", "dc_energy", "consistency")

@dataclass
class SignalTask:
    """Signals of some (layer, site) keys of one file."""

    file: int  # index into the files of the compare
    path: str
    keys: list[tuple[int, int]]
    layers: list[str]
    sites: list[str]
    roles: list[str] = field(default_factory=list)  # the sites' roles (linear, norm, ...)


def run_task(task: SignalTask) -> list[Signals] | str:
    """The task's signals, or the one-line reason its file could not be read."""
    def module(layer: int, site: int) -> str:
        names = task.layers if site == s.BLOCK_SITE else task.sites
        index = layer if site == s.BLOCK_SITE else site
        return names[index] if 0 <= index < len(names) else ""

    def role(layer: int, site: int) -> str:
        if site == s.BLOCK_SITE:
            return "block"
        return task.roles[site] if 0 <= site < len(task.roles) else SUBLAYER

    try:
        reader = open_reader(task.path)
        signals = read_signals(reader, task.keys, module, role,
                               expert_sites(task.sites, task.roles))
    except READ_ERRORS as exc:
        return f"{task.path}: damaged dump file ({first_line(exc)})"
    options = reader.meta.get("dump_config")
    if isinstance(options, dict) and options.get("batch_probes") is False:
        # replayed one by one (--no-batch-probes): the reference is the recorded output
        # itself, so a batch dependence of 0 would be no measurement
        for g in signals:
            g.batch_dep = g.batch_dep_level = g.batch_dep_moved = math.nan
    return signals


def _key_code(layer, site):
    return np.asarray(layer, dtype=np.int64) * 65536 + (np.asarray(site, dtype=np.int64) + 1)


def _read_group(reader: DumpReader, records: np.ndarray, index: list[int]) -> dict[int, np.ndarray]:
    """Decoded data of ``records[index]``: one read per data set when they lie close together."""
    out: dict[int, np.ndarray] = {}
    sub = records[index]
    idx = np.asarray(index)
    for data_id in np.unique(sub["data"]).tolist():
        mine = sub["data"] == data_id
        r0 = sub["row0"][mine]
        n = sub["nrows"][mine]
        lo, hi = int(r0.min()), int((r0 + n).max())
        if hi - lo <= 2 * int(n.sum()) + 64:
            rows = reader.read_rows(data_id, lo, hi)
            for i, a, b in zip(idx[mine].tolist(), (r0 - lo).tolist(), (r0 - lo + n).tolist()):
                r = records[i]
                out[i] = rows[a:b].reshape(int(r["batch"]), int(r["ntok"]), int(r["width"]))
        else:
            for i in idx[mine].tolist():
                out[i] = reader.read(records[i])
    return out


def expert_sites(sites: list[str], roles: list[str]) -> dict[int, list[tuple[int, int]]]:
    """slots site -> [(expert site, expert index)]: the sites whose records a fused experts
    module's slots site holds (docs/dump-format.md, "Experts")."""
    by_name = {name: i for i, name in enumerate(sites)}
    out: dict[int, list[tuple[int, int]]] = {}
    for i, (name, role) in enumerate(zip(sites, roles)):
        if role == EXPERT:
            owner, _, expert = name.rpartition(".")
            slots = by_name.get(owner + ".slots")
            if slots is not None and expert.isdigit():
                out.setdefault(slots, []).append((i, int(expert)))
    return out


def with_experts(keys: list[tuple[int, int]], experts: dict[int, list[tuple[int, int]]]
                 ) -> list[tuple[int, int]]:
    """``keys`` with every slots site replaced by the expert sites it holds."""
    out = []
    for layer, site in keys:
        if site in experts:
            out += [(layer, e) for e, _ in experts[site]]
        else:
            out.append((layer, site))
    return out


def read_signals(
    reader: DumpReader, keys: list[tuple[int, int]], module: Callable[[int, int], str],
    role: Callable[[int, int], str] | None = None,
    experts: dict[int, list[tuple[int, int]]] | None = None,
) -> list[Signals]:
    """Signals of the (layer, site) ``keys`` of one file, reading it round by round;
    ``module(layer, site)`` names each, ``role(layer, site)`` says what it is; ``experts``
    (``expert_sites``) the expert sites a slots site's records hold."""
    recs = reader.records
    # expert keys are read from their slots site's records
    owner = {e: (slots, expert) for slots, members in (experts or {}).items()
             for e, expert in members}
    slots_of = {k: ((k[0], owner[k[1]][0]), owner[k[1]][1]) for k in keys if k[1] in owner}
    by_round = {int(r["round"]): r for r in reader.rounds}
    role = role or (lambda layer, site: "")
    layers = {k: LayerSignals(k[0], k[1], module(*k), role=role(*k)) for k in keys}
    decode = {k: LayerSignals(k[0], k[1], module(*k), phase=DECODE, role=role(*k))
              for k in keys}
    # a block whose model number does not follow the block before it in the dump (--layers
    # 'model.layers.2*': 2, then 20) has no recorded input: the block before is not its input
    gaps = after_gap(layer_numbers(reader.layers))
    unfed = {k for k in keys if k[1] == s.BLOCK_SITE and k[0] in gaps}

    def results() -> list[Signals]:
        # decode steps run other kernels than the prefill: their own signals, kept apart so
        # that neither phase's evidence is averaged away by the other's rounds
        out = [layers[k].result() for k in keys] + [
            decode[k].result() for k in keys if decode[k].samples]
        return [_without_update(g) if (g.layer, g.site) in unfed else g for g in out]

    if reader.has_stats:
        _stats_signals(reader, by_round, layers, decode)
        return results()
    if not len(recs) or not keys:
        return results()
    code = _key_code(recs["layer"], recs["site"])
    read = [slots_of[k][0] if k in slots_of else k for k in keys]
    want = np.isin(code, _key_code([k[0] for k in read], [k[1] for k in read]))
    block_layers = np.array([k[0] for k in keys if k[1] == s.BLOCK_SITE
                             and k not in unfed], dtype=np.int64)
    prev = ((recs["site"] == s.BLOCK_SITE) & (recs["kind"] == s.KIND_CLEAN)
            & np.isin(recs["layer"].astype(np.int64) + 1, block_layers))
    # records of a round cut off by a crash (no row in /rounds) are not trusted
    need = np.flatnonzero((want | prev) & np.isin(recs["round"], list(by_round)))
    if not need.size:
        return results()
    all_rows = reader.all_probe_rows()
    all_positions = reader.all_positions()
    all_ids = reader.all_token_ids()
    # the fields every record's loop reads, as Python lists (a structured array's field and
    # element cost a microsecond each)
    round_of, kind_of = recs["round"].tolist(), recs["kind"].tolist()
    layer_of, site_of = recs["layer"].tolist(), recs["site"].tolist()
    order = np.argsort(recs["round"][need], kind="stable")
    first = {}
    for i in need.tolist():
        first.setdefault(round_of[i], i)
    groups: dict[int, list[int]] = {}
    for i in need[order].tolist():
        groups.setdefault(round_of[i], []).append(i)
    width_bytes = recs["nrows"].astype(np.int64) * recs["width"] * 4
    masks = {int(recs["round"][i]): int(i) for i in np.flatnonzero(recs["kind"] == s.KIND_MASK)}
    holds: dict[tuple[int, int], list[tuple[tuple[int, int], int]]] = {}
    for key, (slots_key, expert) in slots_of.items():
        holds.setdefault(slots_key, []).append((key, expert))

    for rnd in sorted(groups, key=first.__getitem__):
        row = by_round[rnd]
        valid = None  # rows the attention mask keeps (None: every row)
        if rnd in masks:
            valid = reader.read(recs[masks[rnd]]).reshape(-1) != 0
        sample, prefill = int(row["sample"]), int(row["step"]) == 0
        prow = None
        if row["prow_len"] > 0:
            off = int(row["prow_off"])
            prow = all_rows[off: off + int(row["prow_len"])]
        # the token position of every row of a (batch, ntok) record of this round
        pos_off = int(row["pos_off"])
        positions = np.tile(all_positions[pos_off: pos_off + int(row["ntok"])],
                            max(1, int(row["batch"])))
        # the token id of every row, where recorded
        tok_off, tok_len = int(row["tok_off"]), int(row["tok_len"])
        ids = all_ids[tok_off: tok_off + tok_len] if tok_len == positions.size else None
        index = groups[rnd]
        per_key: dict[tuple[int, int], list[int]] = {}
        clean_prev: dict[int, int] = {}  # layer -> last clean block record of the round
        for i in index:
            key = (layer_of[i], site_of[i])
            if key[1] == s.BLOCK_SITE and kind_of[i] == s.KIND_CLEAN \
                    and key[0] + 1 not in gaps:
                clean_prev[key[0]] = i
            if key in layers or key in holds:
                per_key.setdefault(key, []).append(i)
        batch: list[tuple[int, int]] = []
        size = 0
        for key in sorted(per_key):
            batch.append(key)
            size += int(width_bytes[per_key[key]].sum())
            if size >= SPAN_BYTES:
                _round_batch(reader, recs, kind_of, batch, per_key, clean_prev,
                             layers if prefill else decode, sample, prow, valid, positions,
                             holds, ids)
                batch, size = [], 0
        if batch:
            _round_batch(reader, recs, kind_of, batch, per_key, clean_prev,
                         layers if prefill else decode, sample, prow, valid, positions, holds,
                         ids)
    return results()


def _without_update(g: Signals) -> Signals:
    """A block whose input is not in the dump: what it adds (its output less its input) is
    unknown, and so is every statistic of it."""
    for name in UPDATE_FIELDS:
        setattr(g, name, math.nan)
    return g


def _stats_signals(reader: DumpReader, by_round: dict, layers: dict, decode: dict) -> None:
    """A stats dump: its rows are the rounds' reductions, fed in file order."""
    index = reader.stats_index
    code = _key_code(index["layer"], index["site"])
    want = np.isin(code, _key_code([k[0] for k in layers], [k[1] for k in layers]))
    want &= np.isin(index["round"], list(by_round))  # rounds cut off by a crash are not used
    if not want.any():
        return
    values = reader.stats_values()
    layout = StatsLayout(reader.stat_columns)
    for i in np.flatnonzero(want).tolist():
        row = by_round[int(index["round"][i])]
        key = (int(index["layer"][i]), int(index["site"][i]))
        target = layers if int(row["step"]) == 0 else decode
        target[key].add_round(layout.round_stats(values[i], int(row["sample"]),
                                                 s.DTYPE_CODES[int(index["dtype"][i])]))


def _round_batch(reader, recs, kind_of, batch, per_key, clean_prev, layers, sample, prow,
                 valid=None, positions=None, holds=None, ids=None):
    index: list[int] = []
    for key in batch:
        index += per_key[key]
        if key[1] == s.BLOCK_SITE and key[0] - 1 in clean_prev:
            index.append(clean_prev[key[0] - 1])
    data = _read_group(reader, recs, sorted(set(index)))
    one_row = OneRowRecords()
    with np.errstate(all="ignore"):  # faulty layers hold NaN/Inf/1e38: expected, not noise
        for key in batch:
            mine = per_key[key]
            if holds and key in holds:
                _add_experts(reader, recs, mine, data, holds[key], layers, sample, prow, valid,
                             positions, ids)
                continue
            clean = [i for i in mine if kind_of[i] == s.KIND_CLEAN]
            probes = [_probe(recs[i], data[i]) for i in mine
                      if kind_of[i] != s.KIND_CLEAN and kind_of[i] in s.KIND_NAMES]
            before = None
            if key[1] == s.BLOCK_SITE and key[0] - 1 in clean_prev:
                before = data[clean_prev[key[0] - 1]]
            for i in clean:
                x = data[i]
                if not probes and one_row.takes(x, valid):
                    one_row.add(layers[key], x, reader.dtype_of(recs[i]), before)
                    continue
                layers[key].add(x, reader.dtype_of(recs[i]), sample, before, prow,
                                probes, valid, positions, ids=ids)
        one_row.finish(sample)


class OneRowRecords:
    """Clean one-token records without probes, reduced together (``row_stats``) by width,
    dtype and whether a previous block's row comes with them."""

    def __init__(self) -> None:
        self.groups: dict[tuple[int, str, bool], list] = {}

    @staticmethod
    def takes(x: np.ndarray, valid: np.ndarray | None) -> bool:
        """A one-token record whose row the attention mask keeps."""
        if x.ndim != 3 or x.shape[0] != 1 or x.shape[1] != 1:
            return False
        return valid is None or valid.size != 1 or bool(valid.all())

    def add(self, target: LayerSignals, x: np.ndarray, dtype: str,
            before: np.ndarray | None) -> None:
        if before is not None and before.shape != x.shape:
            before = None
        group = self.groups.setdefault((x.shape[-1], dtype, before is not None), [])
        group.append((target, x, before))

    def finish(self, sample: int) -> None:
        """Every record added, reduced and handed to its ``LayerSignals``."""
        for (_, dtype, with_before), group in self.groups.items():
            x = np.concatenate([g[1].reshape(1, -1) for g in group])
            before = (np.concatenate([g[2].reshape(1, -1) for g in group]) if with_before
                      else None)
            for (target, _, _), stats in zip(group, one_row_stats(x, dtype, [sample] * len(group),
                                                                    before)):
                if stats is not None:
                    target.add_round(stats)
        self.groups = {}


def _add_experts(reader, recs, mine, data, members, layers, sample, prow, valid, positions,
                 ids=None) -> None:
    """A slots site's records of one round, as each expert's rows: the tokens routed to it."""
    kinds = recs["kind"][mine]
    route = [i for i, k in zip(mine, kinds) if k == s.KIND_ROUTE]
    clean = [i for i, k in zip(mine, kinds) if k == s.KIND_CLEAN]
    if not route or not clean:
        return
    index, _, margin = split_route(data[route[0]])
    slots = data[clean[0]]
    batch, ntok = slots.shape[:2]
    k = index.shape[1]
    width = slots.shape[-1] // max(1, k)
    dtype = reader.dtype_of(recs[clean[0]])
    probes = [(recs[i], data[i]) for i, kind in zip(mine, kinds)
              if kind not in (s.KIND_CLEAN, s.KIND_ROUTE) and int(kind) in s.KIND_NAMES]
    probe_index = index[prow] if prow is not None and len(prow) else index[:0]
    flat = slots.reshape(-1, slots.shape[-1])
    for key, expert in members:
        if key not in layers:
            continue
        rows, routed = expert_rows(flat, index, expert)
        if not routed.any():
            continue
        mine_valid = routed if valid is None else routed & valid
        own = []
        for record, array in probes:
            if len(probe_index) != array.size // array.shape[-1]:
                continue
            part, _ = expert_rows(array.reshape(-1, array.shape[-1]), probe_index, expert)
            own.append(_probe(record, part.reshape(1, -1, width)))
        margins = margin[mine_valid]
        margins = margins[np.isfinite(margins)]
        layers[key].add(rows.reshape(batch, ntok, width), dtype, sample, None, prow, own,
                        mine_valid, positions,
                        float(np.median(margins)) if margins.size else float("nan"), ids)


def _probe(record: np.void, data: np.ndarray) -> Probe:
    return Probe(s.KIND_NAMES[int(record["kind"])], float(record["param"]),
                 float(record["pert_rms"]), data, bool(record["subset"]))


def present_keys(records: np.ndarray, stack_input: bool = False) -> list[tuple[int, int]]:
    """Every (layer, site) with records (or rows of a stats index: layer, site fields), in
    order; with ``stack_input`` (a dump with normalisation operators: layer 0's input norm
    inherits the stack input's exact zeros, and the diagnosis needs to know them) the stack
    input (layer -1) first."""
    ok = records["layer"] >= 0
    keys = sorted(set(zip(records["layer"][ok].tolist(), records["site"][ok].tolist())))
    stack = records["layer"] == s.STACK_INPUT
    if "kind" in (records.dtype.names or ()):
        stack &= records["kind"] == s.KIND_CLEAN
    if stack_input and np.any(stack):
        keys.insert(0, (s.STACK_INPUT, s.BLOCK_SITE))
    return keys


def chunks(records: np.ndarray, keys: list[tuple[int, int]], jobs: int) -> list[list]:
    """``keys`` in runs of consecutive layers, each about 1 / (2 * jobs) of the bytes left (of
    ``records``, or of the rows of a stats index): large
    runs first, single layers at the end, so no process waits long for the last one. (Every
    run reads its first block's previous layer once more.)"""
    code = _key_code(records["layer"], records["site"])
    if "nrows" in (records.dtype.names or ()):
        nbytes = records["nrows"].astype(np.int64) * records["width"]
    else:  # rows of a stats index: one per round, all alike
        nbytes = np.ones(len(records), dtype=np.int64)
    uniq, inv = np.unique(code, return_inverse=True)
    per = {int(c): int(b) for c, b in zip(uniq, np.bincount(inv, weights=nbytes))}
    weights = [per.get(int(_key_code(*k)), 0) + 1 for k in keys]
    left = sum(weights)
    out, cur, acc = [], [], 0
    for key, w in zip(keys, weights):
        cur.append(key)
        acc += w
        if acc >= left / (2 * jobs):
            out.append(cur)
            left -= acc
            cur, acc = [], 0
    if cur:
        out.append(cur)
    return out
