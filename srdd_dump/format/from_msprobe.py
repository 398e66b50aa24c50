"""An msprobe dump (format/msprobe.py) written as srdd dump files, so that every compare mode
reads it like srdd-dump's own: one file per rank (or process), each msprobe step a sample, each
call of a module within the step a round of that sample (0: the prefill, n: the n-th decode
step).

Blocks are the numbered modules of one stack (``model.layers.N``); their attention and MLP
children are sub-layer sites, their linear and norm modules operator sites. A block that
returns ``(hidden_states, residual)`` of one shape (a serving engine's, e.g. vLLM's) outputs
their sum, the stream, as srdd-dump records it. Where msprobe recorded inputs (data_mode input
or all): block 0's hidden-state input is the stack input, its positions the round's positions,
an ``input_ids`` input the round's token ids. What msprobe does not record is absent, and the
file's status says which evidence that leaves out (format/coverage.py).
"""

from __future__ import annotations

import collections
import hashlib
import os

from ..errors import UserError
from . import schema
from .coverage import Coverage
from .msprobe import LOGICAL, ModuleCall, MsprobeRun, dump_jsons, read_msprobe
from .msprobe_rounds import STAT_COLUMNS, Layout, RoundMaker
from .writer import DumpWriter

CONVERTER = 16  # the cache of converted dumps is keyed by it: bump it when the output changes
ELEMENTS = "output elements"
STATISTICS_ONLY = ("an msprobe statistics dump keeps Max, Min, Mean and Norm of each tensor: no "
                   "kurtosis, zero fraction, pile-up or other element-wise signal")
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
    absolute path, the names, sizes and times of every file of its dump.json folders (the
    tensor files too) and the converter's version, so a changed dump is read again."""
    place = hashlib.blake2b(os.path.abspath(path).encode(), digest_size=6).hexdigest()
    h = hashlib.blake2b(f"{CONVERTER}:{os.path.abspath(path)}".encode(), digest_size=8)
    for _, _, dump_json in dump_jsons(path):
        for name, st in _msprobe_files(os.path.dirname(dump_json)):
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return os.path.join(root, f"msprobe-{place}-{h.hexdigest()}")


def _nothing_to_read(runs: list[MsprobeRun], layout: Layout, tensor_mode: bool
                     ) -> str:
    """Why a dump whose blocks were recorded has no output srdd can read, in words that say
    what to do ("" when it has some): inputs recorded only, a structure dump, or tensor files
    that were not copied with their dump.json."""
    ours = [c for run in runs for c in run.calls if layout.layer_and_site(c.module)]
    if not any(c.outputs for c in ours):
        if any(c.args or c.kwargs for c in ours):
            return ("the msprobe dump records module inputs only (data_mode input); "
                    "srdd-compare reads outputs: dump with data_mode output or all")
        task = runs[0].task or "?"
        return (f"the msprobe dump (task {task}) records no output of the modules it "
                "lists: dump with task tensor or statistics and data_mode output or all")
    missing = [run.path for run in runs
               if not os.path.isdir(os.path.join(run.path, "dump_tensor_data"))]
    if tensor_mode and len(missing) == len(runs):
        return (f"dump.json names tensor files but {missing[0]} has no "
                "dump_tensor_data folder (a dump copied without it?): copy the whole rank "
                "folder")
    return ""


def _not_read(runs: list[MsprobeRun], layout: Layout) -> collections.Counter:
    """The records srdd-compare leaves out, by kind: API calls (level L1 or mix) and calls of
    modules inside the blocks that are no site (an activation, a rotary embedding)."""
    out: collections.Counter = collections.Counter()
    for run in runs:
        out.update(run.api_calls)
        out.update(c.cls for c in run.calls if layout.block_of(c.module)
                   and layout.layer_and_site(c.module) is None)
    return out


def _msprobe_files(folder: str) -> list[tuple[str, os.stat_result]]:
    """(path, stat) of the files msprobe wrote in a rank folder (its .json files and its
    tensor files; not a report a user wrote beside them), sorted by path."""
    names = [n for n in os.listdir(folder) if n.endswith(".json")]
    tensors = os.path.join(folder, "dump_tensor_data")
    if os.path.isdir(tensors):
        names += [os.path.join("dump_tensor_data", n) for n in os.listdir(tensors)]
    out = []
    for name in sorted(names):
        path = os.path.join(folder, name)
        try:
            out.append((path, os.stat(path)))
        except OSError:
            pass
    return out


def _convert_group(path: str, key: tuple, runs: list[MsprobeRun], out_dir: str) -> str:
    calls = [c for run in runs for c in run.calls]
    layout = Layout(calls)
    tensor_mode = any(c.has_tensor for c in calls)
    unusable = _nothing_to_read(runs, layout, tensor_mode)
    if unusable:
        raise UserError(unusable)
    rank, folder = key
    name = f"msprobe_{'rank' + str(rank) if rank is not None else folder}{schema.FILE_SUFFIX}"
    target = os.path.join(out_dir, name)
    hidden = LOGICAL.get(layout.first.output.get("dtype"), "float32")
    first_block = layout.first if layout.first.module in layout.block_index else None
    meta = {
        "tool": "msprobe", "source_dump": os.path.abspath(path), "layers": layout.blocks,
        "block_class": first_block.cls if first_block else "", "hidden_dtype": hidden,
        "param_dtype": hidden,
        "sites": [s[0] for s in layout.sites], "site_roles": [s[2] for s in layout.sites],
        "rank": rank, "pid": None, "device": "", "dump_config": {},
        "command": f"msprobe dump {os.path.abspath(path)}",
    }
    if not tensor_mode:
        meta["statistics_only"] = True
    coverage = Coverage()
    # one round in memory at a time (written before the next is read): a long prefill's
    # round holds every block's output
    writer = DumpWriter(target, meta, layout.blocks, [s[0] for s in layout.sites],
                        max_pending=0,
                        stat_columns=None if tensor_mode else list(STAT_COLUMNS))
    unreadable: dict[str, None] = {}  # why each tensor file left out could not be read
    fed_otherwise: collections.Counter = collections.Counter()  # block -> rounds
    try:
        sample, step, prefill_len, rounds = -1, 0, None, 0
        for run in runs:
            by_call: dict[int, list[ModuleCall]] = collections.defaultdict(list)
            for c in run.calls:
                by_call[c.call].append(c)
            for call in sorted(by_call):
                maker = RoundMaker(run, layout, by_call[call], tensor_mode)
                if maker.shape is None:
                    continue
                if sample >= 0 and ((call > 0 and not maker.is_prefill()) or (
                        len(by_call) == 1 and maker.is_decode_step())):
                    step += 1  # a later call, or a step of its own continuing the last sample
                else:
                    sample, step, prefill_len = sample + 1, 0, maker.shape[1]
                r = maker.round(sample, step, prefill_len)
                unreadable.update(dict.fromkeys(maker.unreadable))
                fed_otherwise.update(maker.fed_otherwise)
                family = f"{'prefill' if step == 0 else 'decode'} block probes"
                coverage.expect(family)
                coverage.failed(family, NO_PROBES)
                writer.submit(r)
                rounds += 1
    except BaseException:
        writer.close({"error": "conversion stopped"})
        raise
    if not tensor_mode:
        coverage.expect(ELEMENTS, rounds)  # every round's outputs, as statistics only
        coverage.failed(ELEMENTS, STATISTICS_ONLY)
    status = {"samples": sample + 1, "requests": 0, "coverage": coverage.as_dict(),
              "converted_from": "msprobe"}
    if unreadable:  # the report names them (compare/sources.capture_notes)
        status["tensors_unreadable"] = len(unreadable)
        status["tensors_unreadable_sites"] = list(unreadable)[:3]
    if fed_otherwise:  # the report names them (compare/sources.LEFT_OUT)
        blocks = fed_otherwise.most_common()
        status["msprobe_inputs_changed"] = sum(fed_otherwise.values())
        status["msprobe_inputs_changed_sites"] = [
            f"{name} ({n} round{'s' if n > 1 else ''})" for name, n in blocks[:3]] + (
            [f"{len(blocks) - 3} more block{'s' if len(blocks) > 4 else ''}"]
            if len(blocks) > 3 else [])
    unread = _not_read(runs, layout)
    if unread:
        status["msprobe_not_read"] = sum(unread.values())
        kinds = unread.most_common()
        status["msprobe_not_read_sites"] = [f"{kind} ({n})" for kind, n in kinds[:5]] + (
            [f"{len(kinds) - 5} other kind{'s' if len(kinds) > 6 else ''} "
             f"({sum(n for _, n in kinds[5:])})"]
            if len(kinds) > 5 else [])
    final = writer.close(status)
    if writer.error:
        raise UserError(f"{target}: cannot write it ({writer.error})")
    return final


