"""The rounds of an msprobe dump (format/msprobe.py) in srdd's terms: which modules are blocks
and sites (``Layout``), and one call number of one step as a writer ``Round`` (``RoundMaker``):
its outputs as tensors, or a statistics dump's rows, with the positions, token ids and stack
input msprobe recorded. Used by format/from_msprobe.py."""

from __future__ import annotations

import collections
import math

import numpy as np

from ..errors import UserError
from ..vocabulary import ATTENTION_NAMES, LINEAR, MLP_NAMES, NORM, SUBLAYER
from . import schema
from .layer_numbers import NUMBERED_PREFIX
from .msprobe import FLOATING, INTEGER, LOGICAL, ModuleCall, MsprobeRun, dims, statistic
from .writer import Round, StatRow, Tensor

# a statistics-mode dump's columns: Max, Min, Mean, Norm as moments where they are some
# and "checksum": the md5 msprobe records with summary_mode md5 (a CRC-32 in 8 hex digits), as a
# number: equal on both sides, the tensors are equal bit for bit
STAT_COLUMNS = ("n", "mean", "m2", "absmax", "nan", "inf", *schema.SUMMARY_COLUMNS, "checksum")
POSITION_NAMES = ("position_ids", "positions")


class Layout:
    """The blocks and sites of a dump, from the modules seen. The blocks are the numbered
    modules of the most common stack (``model.layers.N``), found from the blocks' own calls or,
    in a dump of some of their children only (a ``list`` of layer 10's modules), from the
    children's names."""

    def __init__(self, calls: list[ModuleCall]):
        numbered = collections.Counter(m["stack"] for m in map(NUMBERED_PREFIX.match,
                                                               (c.module for c in calls)) if m)
        if not numbered:
            raise UserError("the msprobe dump holds no module of a numbered block (model.layers"
                            ".N...): dump with level L0 or mix and a 'list' that names the "
                            "decoder layer class or its modules")
        self.stack = numbered.most_common(1)[0][0]
        indices = sorted({int(m["index"]) for m in map(NUMBERED_PREFIX.match,
                                                       (c.module for c in calls))
                          if m and m["stack"] == self.stack})
        self.blocks = [f"{self.stack}.{i}" for i in indices]
        self.block_index = {name: i for i, name in enumerate(self.blocks)}
        sites: dict[str, tuple[str, int, str]] = {}  # in the order dump.json holds them
        for c in calls:
            block = self.block_of(c.module)
            if block is None or c.module == block:
                continue
            rest = c.module[len(block) + 1:]
            role = (SUBLAYER if rest in ATTENTION_NAMES + MLP_NAMES
                    else LINEAR if c.cls.endswith("Linear")
                    else NORM if c.cls.endswith("Norm") else None)
            if role is not None:
                sites.setdefault(c.module, (c.module, self.block_index[block], role))
        self.sites = sorted(sites.values(), key=_made_order(list(sites)))
        self.site_index = {name: i for i, (name, _, _) in enumerate(self.sites)}
        recorded = [c for c in calls if c.module in self.block_index or
                    c.module in self.site_index]
        if not recorded:
            raise UserError("the msprobe dump holds no output of a block, attention, MLP, "
                            f"linear or norm module of {self.stack}.N: dump the decoder layer "
                            "class (msprobe's 'list')")
        self.first = next((c for c in recorded if c.module in self.block_index), recorded[0])

    def block_of(self, module: str) -> str | None:
        m = NUMBERED_PREFIX.match(module)
        return f"{m['stack']}.{m['index']}" if m and m["stack"] == self.stack else None

    def layer_and_site(self, module: str) -> tuple[int, int] | None:
        if module in self.block_index:
            return self.block_index[module], schema.BLOCK_SITE
        if module in self.site_index:
            return self.sites[self.site_index[module]][1], self.site_index[module]
        return None


def _made_order(names: list[str]):
    """Sort key of sites (name, layer, role): by layer, then in the order their outputs were
    made, which the first divergence inside a block reads (the attention before the MLP).
    dump.json holds a module where msprobe first recorded it: its output (a child before its
    parent) or, with inputs recorded, its call's start (a parent before its children); either
    way a module's output comes after those of the modules inside it."""
    last = {name: i for i, name in enumerate(names)}
    for i, name in enumerate(names):  # each name raises the entry of every site it is inside
        parts = name.split(".")
        for k in range(1, len(parts)):
            outer = ".".join(parts[:k])
            if outer in last:
                last[outer] = max(last[outer], i)
    return lambda site: (site[1], last[site[0]], -site[0].count("."))


class RoundMaker:
    """One call number of one step: its outputs as a Round (tensors, or a statistics dump's
    rows)."""

    def __init__(self, run: MsprobeRun, layout: Layout, calls: list[ModuleCall],
                 tensor_mode: bool):
        self.run, self.layout, self.calls, self.tensor_mode = run, layout, calls, tensor_mode
        self.unreadable: list[str] = []  # why a tensor file could not be read, one per file
        self.fed_otherwise: list[str] = []  # blocks whose input is not the last one's output
        shaped = [c for c in calls if c.module in layout.block_index] or \
            [c for c in calls if c.module in layout.site_index]
        self.shape = next((d for d in (dims(c.output) for c in shaped) if d), None)

    def is_decode_step(self) -> bool:
        """One token per sequence at a position past 0 (when recorded): a decode step. A dump
        that steps msprobe at every forward (``start/stop/step`` around each model call, as
        in a serving engine's model runner) holds one per step."""
        if self.shape is None or self.shape[1] != 1:
            return False
        positions = self._positions(self._block0(), 1)
        return positions is None or int(positions[0]) > 0

    def is_prefill(self) -> bool:
        """More than one token per sequence from position 0, as recorded: a new prompt's
        prefill, even as a later call of the step (a dump not stepped between the prompts of
        one start/stop). Without recorded positions a later call stays a step of the sample
        (an assisted generation's multi-token check looks the same)."""
        if self.shape is None or self.shape[1] == 1:
            return False
        positions = self._positions(self._block0(), self.shape[1])
        return positions is not None and int(positions.min()) == 0

    def _block0(self) -> ModuleCall | None:
        return next((c for c in self.calls if c.module == f"{self.layout.stack}.0"), None)

    def round(self, sample: int, step: int, prefill_len: int | None) -> Round | None:
        """The round of decode step ``step`` (0: the prefill) of ``sample``; positions past a
        prefill of ``prefill_len`` tokens unless msprobe recorded them."""
        if self.shape is None:
            return None
        batch, seq, _ = self.shape
        r = Round(sample=sample, step=step, batch=batch, seq=seq,
                  positions=np.zeros(0, dtype=np.int64), probe_rows=None)
        block0 = self._block0()
        self.fed_otherwise = self._fed_otherwise()
        stack_input = self._stack_input(block0)
        if stack_input is not None:
            self._add(r, schema.STACK_INPUT, schema.BLOCK_SITE, [stack_input], block0)
        for c in sorted(self.calls, key=lambda c: self.layout.layer_and_site(c.module) or
                        (-9, 0)):
            where = self.layout.layer_and_site(c.module)
            if where is None or dims(c.output) is None or dims(c.output)[:2] != (batch, seq):
                continue
            self._add(r, *where, self._outputs(c), c)
        start = 0 if step == 0 or prefill_len is None else prefill_len + step - 1
        positions = self._positions(block0, seq)
        r.positions = np.arange(start, start + seq) if positions is None else positions
        r.token_ids = self._token_ids((batch, seq)) if self.tensor_mode else None
        return r

    def _outputs(self, c: ModuleCall) -> list[dict]:
        """The entries whose sum is the module's output: a block's (hidden_states, residual)
        of one shape (the serving convention), else the first output."""
        if c.module in self.layout.block_index and len(c.outputs) >= 2 \
                and dims(c.outputs[1]) == dims(c.outputs[0]) \
                and c.outputs[1].get("dtype") == c.outputs[0].get("dtype"):
            return c.outputs[:2]
        return c.outputs[:1]

    def _add(self, r: Round, layer: int, site: int, entries: list[dict], c: ModuleCall) -> None:
        logical = LOGICAL.get(entries[0].get("dtype"))
        if logical is None:
            return
        if not self.tensor_mode:
            r.stats.append(StatRow(layer=layer, site=site,
                                   dtype=schema.DTYPE_CODES.index(logical),
                                   values=stat_values(entries)))
            return
        if not all(isinstance(e.get("data_name"), str) for e in entries):
            return
        # stored as it was saved when one tensor (bfloat16: its bits)
        parts = [self._read(c, e, bfloat16_bits=len(entries) == 1) for e in entries]
        if any(x is None for x in parts):  # a file missing or cut short: the others compared
            return
        if len(parts) == 1:
            array = np.ascontiguousarray(parts[0].reshape(r.batch, r.seq, -1),
                                         dtype=schema.STORAGE_DTYPES[logical])
        else:
            x = sum(x.astype(np.float32) for x in parts)
            array = _storage(x.reshape(r.batch, r.seq, -1), logical)
        r.tensors.append(Tensor(layer=layer, site=site, dtype=logical, array=array))

    def _fed_otherwise(self) -> list[str]:
        """The blocks whose recorded hidden-state input differs from the recorded output of
        the block before them (data_mode all): something between the two modules changed the
        stream (code outside the blocks, a hook run after msprobe's), which the layer-by-layer
        reading, taking a block's input to be the last block's output, names at the block it
        feeds. By the statistics msprobe records of both (equal for one tensor)."""
        # by the model's layer number: a dump of layers 3 and 7 has no block before 7
        blocks = {int(NUMBERED_PREFIX.match(c.module)["index"]): c for c in self.calls
                  if c.module in self.layout.block_index}
        out = []
        for number, c in sorted(blocks.items()):
            before = blocks.get(number - 1)
            if before is None or len(self._outputs(before)) != 1:
                continue  # the serving convention's (hidden_states, residual): not one tensor
            fed = self._stack_input(c)
            if fed is not None and _differ(fed, before.outputs[0]):
                out.append(c.module)
        return out

    def _stack_input(self, block0: ModuleCall | None) -> dict | None:
        """Block 0's hidden-state input: its first floating-point input shaped like its
        output (with the serving convention, the one after ``positions``)."""
        if block0 is None:
            return None
        want = dims(block0.output)
        inputs = [*block0.args, block0.kwargs.get("hidden_states")]
        return next((e for e in inputs if e is not None and e.get("dtype") in FLOATING
                     and dims(e) == want), None)

    def _positions(self, block0: ModuleCall | None, seq: int) -> np.ndarray | None:
        """The round's token positions from block 0's position input: the saved tensor's
        first row, or a statistics dump's Min..Max when they span the round."""
        if block0 is None:
            return None
        named = [block0.kwargs.get(k) for k in POSITION_NAMES]
        entry = next((e for e in [*named, *block0.args] if e is not None
                      and e.get("dtype") in INTEGER and _length(e) == seq), None)
        if entry is None:
            return None
        if self.tensor_mode and isinstance(entry.get("data_name"), str):
            x = self._read(block0, entry)
            return None if x is None else x.reshape(-1, seq)[0].astype(np.int64)
        low, high = statistic(entry, "Min"), statistic(entry, "Max")
        if low is not None and high is not None and high - low + 1 == seq:
            return np.arange(int(low), int(high) + 1)
        return None

    def _token_ids(self, shape: tuple[int, int]) -> np.ndarray | None:
        """The round's input ids: an ``input_ids`` input of any module, or the integer first
        input of a module outside the blocks (the model's, the embedding's)."""
        for c in self.calls:
            candidates = [c.kwargs.get("input_ids")]
            if self.layout.block_of(c.module) is None and c.args:
                candidates.append(c.args[0])
            for entry in candidates:
                if entry is None or entry.get("dtype") not in INTEGER \
                        or not isinstance(entry.get("data_name"), str):
                    continue
                if entry.get("shape") in ([*shape], [shape[1]] if shape[0] == 1 else None):
                    x = self._read(c, entry)
                    return None if x is None else x.reshape(shape).astype(np.int64)
        return None

    def _read(self, c: ModuleCall, entry: dict, bfloat16_bits: bool = False
              ) -> np.ndarray | None:
        """A saved tensor, or None (and why, in ``unreadable``) when its file cannot be read."""
        try:
            return np.asarray(self.run.tensor(c, entry, bfloat16_bits=bfloat16_bits))
        except UserError as exc:
            self.unreadable.append(str(exc))
            return None


def _differ(a: dict, b: dict) -> bool:
    """Two recorded tensors are not one: another shape, Max or Min, Mean or Norm beyond a
    millionth of their scale, or md5 (all as msprobe recorded them)."""
    if dims(a) != dims(b):
        return True
    if a.get("md5") and b.get("md5") and a["md5"] != b["md5"]:
        return True
    values = {k: (statistic(a, k), statistic(b, k)) for k in ("Max", "Min", "Mean", "Norm")}
    if any(x is None or y is None or math.isnan(x) or math.isnan(y)
           for x, y in values.values()):
        return False
    if values["Max"][0] != values["Max"][1] or values["Min"][0] != values["Min"][1]:
        return True
    scale = max(abs(values["Max"][0]), abs(values["Min"][0]), 1e-30)
    norm = max(abs(values["Norm"][0]), 1e-30)
    return (abs(values["Mean"][0] - values["Mean"][1]) > 1e-6 * scale
            or abs(values["Norm"][0] - values["Norm"][1]) > 1e-6 * norm)


def _length(entry: dict) -> int | None:
    """The last dimension of an integer entry of shape (tokens,) or (batch, tokens)."""
    shape = entry.get("shape")
    ok = isinstance(shape, list) and len(shape) in (1, 2) and all(isinstance(d, int)
                                                                 for d in shape)
    return shape[-1] if ok else None


def stat_values(entries: list[dict]) -> np.ndarray:
    """STAT_COLUMNS of an output recorded as statistics (Max, Min, Mean, Norm; NaN: not
    recorded). Of a sum of entries (hidden_states + residual) only the count and mean."""
    shape = dims(entries[0])
    n = int(np.prod(shape)) if shape else math.nan
    recorded = [[statistic(e, k) for k in ("Max", "Min", "Mean", "Norm")] for e in entries]
    values = [v for row in recorded for v in row if v is not None]
    nan = any(math.isnan(v) for v in values)
    inf = not nan and any(math.isinf(v) for v in values)
    unknown = math.nan
    if len(entries) > 1:
        means = [row[2] for row in recorded]
        mean = sum(means) if None not in means and not (nan or inf) else unknown
        return np.array([n, mean, unknown, unknown, int(nan), int(inf), unknown, unknown,
                         unknown, unknown], dtype=np.float64)
    max_, min_, mean, norm = (unknown if v is None else v for v in recorded[0])
    finite = not nan and not inf
    m2 = max(norm * norm - n * mean * mean, 0.0) if finite else unknown
    absmax = max(abs(max_), abs(min_)) if finite else unknown
    return np.array([n, mean if finite else unknown, m2, absmax, int(nan), int(inf),
                     max_, min_, norm, _checksum(entries[0])], dtype=np.float64)


def _checksum(entry: dict) -> float:
    """msprobe's md5 of a tensor (summary_mode md5: a CRC-32, 8 hex digits) as an exact
    float; NaN when it recorded none."""
    text = entry.get("md5")
    if isinstance(text, str) and 0 < len(text) <= 13:
        try:
            return float(int(text, 16))
        except ValueError:
            pass
    return math.nan


def _storage(x: np.ndarray, logical: str) -> np.ndarray:
    """A sum computed here in float32, in its storage dtype (bfloat16: rounded to nearest)."""
    if logical == "bfloat16":
        return schema.float32_to_bf16_bits(np.ascontiguousarray(x, dtype=np.float32))
    return np.ascontiguousarray(x, dtype=schema.STORAGE_DTYPES[logical])
