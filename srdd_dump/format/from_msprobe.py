"""An msprobe dump (format/msprobe.py) written as srdd dump files, so that every compare mode
reads it like srdd-dump's own: one file per rank (or process), each msprobe step a sample, each
call of a module within the step a round of that sample (0: the prefill, n: the n-th decode
step).

Blocks are the numbered modules of one class (``model.layers.N``: the decoder layers); their
attention and MLP children are sub-layer sites, their linear and norm modules operator sites.
What msprobe does not record is absent, and the file's status says which evidence that leaves
out (format/coverage.py): no probe replays, no token ids (rounds pair by order).
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
import re

import numpy as np

from ..errors import UserError
from ..vocabulary import ATTENTION_NAMES, LINEAR, MLP_NAMES, NORM, SUBLAYER
from . import schema
from .coverage import Coverage
from .msprobe import ModuleCall, MsprobeRun, dump_jsons, read_msprobe
from .writer import DumpWriter, Round, StatRow, Tensor

# a module of a numbered block: the block itself or one of its children (the first number in
# the path: model.layers.3.mlp.experts.5.up_proj -> model.layers, 3)
NUMBERED_PREFIX = re.compile(r"^(?P<stack>.+?)\.(?P<index>\d+)(?:\.|$)")
LOGICAL = {"torch.float32": "float32", "torch.bfloat16": "bfloat16",
           "torch.float16": "float16", "torch.float64": "float64"}
CONVERTER = 3  # the cache of converted dumps is keyed by it: bump it when the output changes
INTEGER = ("torch.int64", "torch.int32")
ELEMENTS = "output elements"
STATISTICS_ONLY = ("an msprobe statistics dump keeps Max, Min, Mean and Norm of each tensor: no "
                   "kurtosis, zero fraction, pile-up or other element-wise signal")
NO_PROBES = "an msprobe dump holds the recorded outputs only: no probe replays"
# a statistics-mode dump's columns: Max, Min, Mean, Norm as moments where they are some
STAT_COLUMNS = ("n", "mean", "m2", "absmax", "nan", "inf", *schema.SUMMARY_COLUMNS)


def convert(path: str, out_dir: str) -> list[str]:
    """srdd dump files of the msprobe dump at ``path`` in ``out_dir`` (one per rank or
    process); UserError, one line, when it is not one srdd can read."""
    runs = read_msprobe(path)
    groups: dict[tuple, list[MsprobeRun]] = collections.defaultdict(list)
    for run in runs:
        groups[(run.rank, os.path.basename(run.path))].append(run)
    os.makedirs(out_dir, exist_ok=True)
    return [_convert_group(path, key, sorted(group, key=lambda r: r.step), out_dir)
            for key, group in sorted(groups.items(), key=lambda kv: str(kv[0]))]


def cache_folder(path: str, root: str) -> str:
    """Where the srdd files of the msprobe dump at ``path`` are kept: named by the dump's
    absolute path and its dump.json files' sizes and times, so a changed dump is read again."""
    h = hashlib.blake2b(f"{CONVERTER}:{os.path.abspath(path)}".encode(), digest_size=8)
    for _, _, dump_json in dump_jsons(path):
        st = os.stat(dump_json)
        h.update(f"{dump_json}:{st.st_size}:{st.st_mtime_ns}".encode())
    return os.path.join(root, f"msprobe-{h.hexdigest()}")


def _layout(calls: list[ModuleCall]) -> tuple[list[str], list[tuple[str, int, str]]]:
    """(block names by layer, sites as (name, layer, role)) from the modules seen. The blocks
    are the numbered modules of the most common stack (``model.layers.N``), found from the
    blocks' own calls or, in a dump of some of their children only (a ``list`` of layer 10's
    modules), from the children's names."""
    numbered = collections.Counter()
    for c in calls:
        m = NUMBERED_PREFIX.match(c.module)
        if m:
            numbered[m["stack"]] += 1
    if not numbered:
        raise UserError("the msprobe dump holds no module of a numbered block (model.layers.N."
                        "...): dump with level L0 or mix and a 'list' that names the decoder "
                        "layer class or its modules")
    stack = numbered.most_common(1)[0][0]
    indices = sorted({int(m["index"]) for m in map(NUMBERED_PREFIX.match,
                                                   (c.module for c in calls))
                      if m and m["stack"] == stack})
    blocks = [f"{stack}.{i}" for i in indices]
    layer_of = {name: i for i, name in enumerate(blocks)}
    sites = {}
    for c in calls:
        m = NUMBERED_PREFIX.match(c.module)
        if not m or m["stack"] != stack or c.module in layer_of:
            continue
        block = f"{stack}.{m['index']}"
        rest = c.module[len(block) + 1:]
        role = (SUBLAYER if rest in ATTENTION_NAMES + MLP_NAMES
                else LINEAR if c.cls == "Linear"
                else NORM if c.cls.endswith("Norm") else None)
        if role is not None:
            sites.setdefault(c.module, (c.module, layer_of[block], role))
    return blocks, sorted(sites.values(), key=lambda s: (s[1], s[0]))


def _convert_group(path: str, key: tuple, runs: list[MsprobeRun], out_dir: str) -> str:
    calls = [c for run in runs for c in run.calls]
    blocks, sites = _layout(calls)
    block_index = {name: i for i, name in enumerate(blocks)}
    site_index = {name: i for i, (name, _, _) in enumerate(sites)}
    tensor_mode = any(c.has_tensor for c in calls)
    rank, folder = key
    name = f"msprobe_{'rank' + str(rank) if rank is not None else folder}{schema.FILE_SUFFIX}"
    target = os.path.join(out_dir, name)
    first_block = next((c for c in calls if c.module in block_index), None)
    shaped = first_block or next(c for c in calls if c.module in site_index)
    hidden = LOGICAL.get(shaped.output.get("dtype"), "float32")
    meta = {
        "tool": "msprobe", "source_dump": os.path.abspath(path), "layers": blocks,
        "block_class": first_block.cls if first_block else "", "hidden_dtype": hidden,
        "param_dtype": hidden,
        "sites": [s[0] for s in sites], "site_roles": [s[2] for s in sites],
        "rank": rank, "pid": None, "device": "", "dump_config": {},
        "command": f"msprobe dump {os.path.abspath(path)}",
    }
    coverage = Coverage()
    if not tensor_mode:
        meta["statistics_only"] = True
    writer = DumpWriter(target, meta, blocks, [s[0] for s in sites],
                        stat_columns=None if tensor_mode else list(STAT_COLUMNS))
    rounds = 0
    for sample, run in enumerate(runs):
        by_call: dict[int, list[ModuleCall]] = collections.defaultdict(list)
        for c in run.calls:
            by_call[c.call].append(c)
        prefill_len = None
        for call in sorted(by_call):
            r = _round(run, sample, call, by_call[call], block_index, site_index, prefill_len,
                       tensor_mode)
            if r is None:
                continue
            if call == 0:
                prefill_len = r.seq
            for phase_family in (f"{'prefill' if call == 0 else 'decode'} block probes",):
                coverage.expect(phase_family)
                coverage.failed(phase_family, NO_PROBES)
            writer.submit(r)
            rounds += 1
    if not tensor_mode:
        coverage.expect(ELEMENTS)
        coverage.failed(ELEMENTS, STATISTICS_ONLY)
    status = {"samples": len(runs), "requests": 0, "coverage": coverage.as_dict(),
              "converted_from": "msprobe"}
    final = writer.close(status)
    if writer.error:
        raise UserError(f"{target}: cannot write it ({writer.error})")
    return final


def _round(run: MsprobeRun, sample: int, call: int, calls: list[ModuleCall],
           block_index: dict, site_index: dict, prefill_len: int | None,
           tensor_mode: bool = True) -> Round | None:
    tensors, stats = [], []
    # the round's (batch, tokens): from its blocks' outputs, or its sites' without them
    shaped = [c for c in calls if c.module in block_index] or \
        [c for c in calls if c.module in site_index]
    shape = next((d[:2] for d in (_dims(c.output.get("shape")) for c in shaped) if d), None)
    for c in sorted(calls, key=lambda c: (block_index.get(c.module, -2), c.module)):
        layer = block_index.get(c.module)
        site = schema.BLOCK_SITE
        if layer is None:
            if c.module not in site_index:
                continue
            site = site_index[c.module]
            layer = next(i for name, i in block_index.items() if c.module.startswith(name + "."))
        dims = _dims(c.output.get("shape"))
        if dims is None:
            continue
        if dims[:2] != shape:
            continue  # not shaped like the round's tokens
        logical = LOGICAL.get(c.output.get("dtype"), "float32")
        if not tensor_mode:
            stats.append(StatRow(layer=layer, site=site,
                                 dtype=schema.DTYPE_CODES.index(logical),
                                 values=_stat_values(c.output, int(np.prod(dims)))))
            continue
        if not c.has_tensor:
            continue
        x = run.tensor(c)
        x = x.reshape(dims) if x.size == int(np.prod(dims)) else x
        if x.ndim != 3:
            continue
        tensors.append(Tensor(layer=layer, site=site, array=_storage(x, logical),
                              dtype=logical))
    if shape is None:
        return None
    batch, seq = int(shape[0]), int(shape[1])
    start = 0 if call == 0 or prefill_len is None else prefill_len + call - 1
    first = next((c for c in calls if block_index.get(c.module) == 0), None)
    positions = _positions(run, first, seq, tensor_mode)
    r = Round(sample=sample, step=call, batch=batch, seq=seq,
              positions=np.arange(start, start + seq) if positions is None else positions,
              token_ids=_token_ids(run, calls, (batch, seq)) if tensor_mode else None,
              probe_rows=None)
    r.tensors = [t for t in tensors if t.array.shape[:2] == (batch, seq)]
    r.stats = stats
    stack_input = first.input if first is not None else None
    if stack_input is not None and _dims(stack_input.get("shape")) == (batch, seq, _width(first)):
        logical = LOGICAL.get(stack_input.get("dtype"), "float32")
        if not tensor_mode:
            r.stats.insert(0, StatRow(layer=schema.STACK_INPUT, site=schema.BLOCK_SITE,
                                      dtype=schema.DTYPE_CODES.index(logical),
                                      values=_stat_values(stack_input, batch * seq
                                                          * _width(first))))
        elif stack_input.get("data_name"):
            x = run.tensor(first, stack_input).reshape(batch, seq, -1)
            r.tensors.insert(0, Tensor(layer=schema.STACK_INPUT, array=_storage(x, logical),
                                       dtype=logical))
    return r


def _width(call: ModuleCall) -> int:
    dims = _dims(call.output.get("shape"))
    return dims[2] if dims else -1


def _positions(run: MsprobeRun, block: ModuleCall | None, seq: int, tensor_mode: bool
               ) -> np.ndarray | None:
    """The round's token positions from the first block's position_ids (data_mode input or
    all): the saved tensor's first row, or a statistics dump's Min..Max when they span seq."""
    entry = block.kwargs.get("position_ids") if block is not None else None
    if entry is None or not isinstance(entry.get("shape"), list) or entry["shape"][-1:] != [seq]:
        return None
    if tensor_mode and entry.get("data_name"):
        return np.asarray(run.tensor(block, entry)).reshape(-1, seq)[0].astype(np.int64)
    low, high = entry.get("Min"), entry.get("Max")
    if isinstance(low, int) and isinstance(high, int) and high - low + 1 == seq:
        return np.arange(low, high + 1)
    return None


def _token_ids(run: MsprobeRun, calls: list[ModuleCall], shape: tuple[int, int]
               ) -> np.ndarray | None:
    """The round's input ids: an integer input of (batch, seq) of any module dumped with its
    inputs (the model's input_ids, the embedding's input)."""
    for c in calls:
        for entry in (c.kwargs.get("input_ids"), c.input):
            if entry is None or entry.get("dtype") not in INTEGER or not entry.get("data_name"):
                continue
            dims = entry.get("shape")
            if dims in ([*shape], [shape[1]] if shape[0] == 1 else None):
                return np.asarray(run.tensor(c, entry)).reshape(shape).astype(np.int64)
    return None


def _dims(shape) -> tuple[int, int, int] | None:
    """(batch, seq, width) of an output's recorded shape; 2-D outputs as batch 1."""
    if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
        return None
    if len(shape) == 2:
        shape = [1, *shape]
    return tuple(shape) if len(shape) == 3 else None


def _stat_values(entry: dict, n: int) -> np.ndarray:
    """STAT_COLUMNS of one tensor entry's Max, Min, Mean, Norm (NaN: not recorded)."""
    def number(key: str) -> float:
        try:
            return float(entry.get(key))
        except (TypeError, ValueError):
            return math.nan

    max_, min_, mean, norm = (number(k) for k in ("Max", "Min", "Mean", "Norm"))
    recorded = [v for v in (max_, min_, mean, norm) if not math.isnan(v)]
    nan = any(k in entry and math.isnan(number(k)) for k in ("Max", "Min", "Mean", "Norm"))
    inf = any(math.isinf(v) for v in recorded)
    finite = not nan and not inf
    m2 = max(norm * norm - n * mean * mean, 0.0) if finite else math.nan
    absmax = max(abs(max_), abs(min_)) if finite else math.nan
    return np.array([n, mean if finite else math.nan, m2, absmax, int(nan), int(inf),
                     max_, min_, norm], dtype=np.float64)


def _storage(x: np.ndarray, logical: str) -> np.ndarray:
    """The array in its storage dtype (bfloat16: its 16 bits, exact: it was widened from them)."""
    if logical == "bfloat16":
        return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(
            np.uint16)
    return np.ascontiguousarray(x, dtype=schema.STORAGE_DTYPES[logical])
