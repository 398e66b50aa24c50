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
import os
import re

import numpy as np

from ..errors import UserError
from ..vocabulary import ATTENTION_NAMES, LINEAR, MLP_NAMES, NORM, SUBLAYER
from . import schema
from .coverage import Coverage
from .msprobe import ModuleCall, MsprobeRun, read_msprobe
from .writer import DumpWriter, Round, Tensor

NUMBERED = re.compile(r"^(?P<stack>.+)\.(?P<index>\d+)$")
LOGICAL = {"torch.float32": "float32", "torch.bfloat16": "bfloat16",
           "torch.float16": "float16", "torch.float64": "float64"}
NO_PROBES = "an msprobe dump holds the recorded outputs only: no probe replays"


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
    h = hashlib.blake2b(os.path.abspath(path).encode(), digest_size=8)
    for run in read_msprobe(path):
        st = os.stat(os.path.join(run.path, "dump.json"))
        h.update(f"{run.path}:{st.st_size}:{st.st_mtime_ns}".encode())
    return os.path.join(root, f"msprobe-{h.hexdigest()}")


def _layout(calls: list[ModuleCall]) -> tuple[list[str], list[tuple[str, int, str]]]:
    """(block names by layer, sites as (name, layer, role)) from the modules seen."""
    numbered = collections.Counter()
    for c in calls:
        m = NUMBERED.match(c.module)
        if m:
            numbered[(m["stack"], c.cls)] += 1
    if not numbered:
        raise UserError("the msprobe dump holds no numbered blocks (model.layers.N): dump the "
                        "decoder layer class (msprobe's 'list')")
    (stack, cls), _ = numbered.most_common(1)[0]
    indices = sorted({int(NUMBERED.match(c.module)["index"]) for c in calls
                      if c.cls == cls and NUMBERED.match(c.module)
                      and NUMBERED.match(c.module)["stack"] == stack})
    blocks = [f"{stack}.{i}" for i in indices]
    layer_of = {name: i for i, name in enumerate(blocks)}
    sites = {}
    for c in calls:
        for block, layer in layer_of.items():
            if c.module.startswith(block + "."):
                rest = c.module[len(block) + 1:]
                role = (SUBLAYER if rest in ATTENTION_NAMES + MLP_NAMES
                        else LINEAR if c.cls == "Linear"
                        else NORM if c.cls.endswith("Norm") else None)
                if role is not None:
                    sites.setdefault(c.module, (c.module, layer, role))
    return blocks, sorted(sites.values(), key=lambda s: (s[1], s[0]))


def _convert_group(path: str, key: tuple, runs: list[MsprobeRun], out_dir: str) -> str:
    calls = [c for run in runs for c in run.calls]
    blocks, sites = _layout(calls)
    block_index = {name: i for i, name in enumerate(blocks)}
    site_index = {name: i for i, (name, _, _) in enumerate(sites)}
    tensor_mode = any(c.has_tensor for c in calls)
    if not tensor_mode:
        raise UserError(f"{path}: a statistics-mode msprobe dump (no saved tensors); only "
                        "tensor-mode dumps are read so far")
    rank, folder = key
    name = f"msprobe_{'rank' + str(rank) if rank is not None else folder}{schema.FILE_SUFFIX}"
    target = os.path.join(out_dir, name)
    first_block = next(c for c in calls if c.module in block_index)
    hidden = LOGICAL.get(first_block.output.get("dtype"), "float32")
    meta = {
        "tool": "msprobe", "source_dump": os.path.abspath(path), "layers": blocks,
        "block_class": first_block.cls, "hidden_dtype": hidden, "param_dtype": hidden,
        "sites": [s[0] for s in sites], "site_roles": [s[2] for s in sites],
        "rank": rank, "pid": None, "device": "", "dump_config": {},
        "command": f"msprobe dump {os.path.abspath(path)}",
    }
    coverage = Coverage()
    writer = DumpWriter(target, meta, blocks, [s[0] for s in sites])
    rounds = 0
    for sample, run in enumerate(runs):
        by_call: dict[int, list[ModuleCall]] = collections.defaultdict(list)
        for c in run.calls:
            by_call[c.call].append(c)
        prefill_len = None
        for call in sorted(by_call):
            r = _round(run, sample, call, by_call[call], block_index, site_index, prefill_len)
            if r is None:
                continue
            if call == 0:
                prefill_len = r.seq
            for phase_family in (f"{'prefill' if call == 0 else 'decode'} block probes",):
                coverage.expect(phase_family)
                coverage.failed(phase_family, NO_PROBES)
            writer.submit(r)
            rounds += 1
    status = {"samples": len(runs), "requests": 0, "coverage": coverage.as_dict(),
              "converted_from": "msprobe"}
    final = writer.close(status)
    if writer.error:
        raise UserError(f"{target}: cannot write it ({writer.error})")
    return final


def _round(run: MsprobeRun, sample: int, call: int, calls: list[ModuleCall],
           block_index: dict, site_index: dict, prefill_len: int | None) -> Round | None:
    tensors = []
    shape = None
    for c in sorted(calls, key=lambda c: (block_index.get(c.module, -2), c.module)):
        layer = block_index.get(c.module)
        site = schema.BLOCK_SITE
        if layer is None:
            if c.module not in site_index:
                continue
            site = site_index[c.module]
            layer = next(i for name, i in block_index.items() if c.module.startswith(name + "."))
        if not c.has_tensor:
            continue
        x = run.tensor(c)
        if x.ndim == 2:
            x = x[None]
        if x.ndim != 3:
            continue
        if site == schema.BLOCK_SITE:
            shape = shape or x.shape[:2]
        elif shape is not None and x.shape[:2] != shape:
            continue  # not shaped like the round's tokens
        logical = LOGICAL.get(c.output.get("dtype"), "float32")
        tensors.append(Tensor(layer=layer, site=site, array=_storage(x, logical),
                              dtype=logical))
    if shape is None:
        return None
    batch, seq = int(shape[0]), int(shape[1])
    start = 0 if call == 0 or prefill_len is None else prefill_len + call - 1
    r = Round(sample=sample, step=call, batch=batch, seq=seq,
              positions=np.arange(start, start + seq), token_ids=None, probe_rows=None)
    r.tensors = [t for t in tensors if t.array.shape[:2] == (batch, seq)]
    return r


def _storage(x: np.ndarray, logical: str) -> np.ndarray:
    """The array in its storage dtype (bfloat16: its 16 bits, exact: it was widened from them)."""
    if logical == "bfloat16":
        return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(
            np.uint16)
    return np.ascontiguousarray(x, dtype=schema.STORAGE_DTYPES[logical])
