"""msprobe (mindstudio-probe) PyTorch dumps, read as they are: the folders users already hold.

Layout: ``<dump>/step{S}/rank{R}/`` (``proc{PID}`` when torch.distributed was not initialised)
with ``dump.json`` (``{task, level, framework, data: {name: {input_args, input_kwargs, output,
parameters}}}``), ``construct.json``, ``stack.json`` and, in tensor mode,
``dump_tensor_data/*.pt`` (torch.save; read by ``torch_file.read_tensor``). A module's name is
``Module.<module path>.<class>.forward.<call>``: the call counts the module's calls within the
step (with HF generate in one start/stop/step: 0 is the prefill, n the n-th decode step). Each
tensor entry holds ``dtype, shape, Max, Min, Mean, Norm`` and, in tensor mode, ``data_name``.
Torch-free; nothing in a dump is executed.
"""

from __future__ import annotations

import collections
import json
import os
import re
from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError
from .torch_file import read_tensor

MODULE_NAME = re.compile(r"^Module\.(?P<module>.+)\.(?P<cls>[A-Za-z_]\w*)\.forward\.(?P<call>\d+)$")
RUN_FOLDER = re.compile(r"^(rank|proc)(\d*)$")  # "rank" alone: a run without distributed
STEP_FOLDER = re.compile(r"^step(\d+)$")


INTEGER = ("torch.int64", "torch.int32")
# msprobe's dtype names of floating-point tensors -> srdd's logical dtype names
LOGICAL = {"torch.float32": "float32", "torch.bfloat16": "bfloat16",
           "torch.float16": "float16", "torch.float64": "float64"}
FLOATING = tuple(LOGICAL)


@dataclass
class ModuleCall:
    """One module call as msprobe recorded it: the tensor entries of its output and inputs
    (each ``{type, dtype, shape, Max, Min, Mean, Norm[, data_name]}``)."""

    module: str  # the module's path in the model: "model.layers.3.self_attn"
    cls: str  # its class: "LlamaAttention"
    call: int  # its call number within the step
    outputs: list[dict] = field(default_factory=list)  # the output's tensors, in order
    args: list[dict | None] = field(default_factory=list)  # positional inputs (None: no
    # tensor), recorded with data_mode input or all
    kwargs: dict[str, dict] = field(default_factory=dict)  # keyword inputs that are tensors

    @property
    def output(self) -> dict:
        """The first tensor of the output ({} when it has none)."""
        return self.outputs[0] if self.outputs else {}

    @property
    def has_tensor(self) -> bool:
        return isinstance(self.output.get("data_name"), str) and bool(self.output["data_name"])


@dataclass
class MsprobeRun:
    """One ``step{S}/{rank|proc}{N}`` folder."""

    path: str
    step: int
    rank: int | None  # None: a proc{PID} folder (no torch.distributed)
    task: str
    level: str
    calls: list[ModuleCall] = field(default_factory=list)
    # records that are no module call (API calls of level L1 or mix: "Functional.linear"),
    # counted by kind
    api_calls: collections.Counter = field(default_factory=collections.Counter)

    def tensor(self, call: ModuleCall, entry: dict | None = None,
               bfloat16_bits: bool = False) -> np.ndarray:
        """The saved tensor of ``entry`` (default: the call's first output), float32 for
        bfloat16 (its 16 bits as uint16 with ``bfloat16_bits``), in the shape dump.json gives
        it. UserError, one line, when it was not saved or does not match its entry."""
        entry = call.output if entry is None else entry
        name = entry.get("data_name")
        if not isinstance(name, str) or not name:
            raise UserError(f"{self.path}: {call.module} call {call.call} has no saved tensor "
                            f"(a {self.task} dump)")
        path = os.path.join(self.path, "dump_tensor_data", os.path.basename(name))
        x = read_tensor(path, bfloat16_bits)
        shape = entry.get("shape")
        if isinstance(shape, list) and all(isinstance(d, int) for d in shape):
            if x.size != int(np.prod(shape)):
                raise UserError(f"{path}: holds {x.size} values, dump.json says shape {shape}")
            x = x.reshape(shape)
        return x


def _record_kind(name: str) -> str:
    """The kind of a record that is no module's forward call, for a note: an API call by its
    first two parts ("Functional.linear"), a module's backward or gradients by that word."""
    if name.startswith("Module."):
        return "Module backward" if ".backward." in name else f"Module {name.rsplit('.', 1)[-1]}"
    return ".".join(name.split(".")[:2])


def dims(entry: dict | None) -> tuple[int, int, int] | None:
    """(batch, tokens, width) of a tensor entry's recorded shape, a 2-D one as batch 1; None
    for any other shape."""
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        return None
    if len(shape) == 2:
        shape = [1, *shape]
    return (shape[0], shape[1], shape[2]) if len(shape) == 3 else None


def statistic(entry: dict, key: str) -> float | None:
    """One recorded statistic (Max, Min, Mean, Norm) as a float: NaN and Inf as recorded,
    None when msprobe recorded none (null, absent: a bool or empty tensor)."""
    value = entry.get(key)
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def is_msprobe_dump(path: str) -> bool:
    """A folder holding msprobe's dump.json files (itself, or step/rank folders below it)."""
    return bool(dump_jsons(path))


def read_msprobe(path: str) -> list[MsprobeRun]:
    """Every step/rank run of an msprobe dump, by step then rank; UserError, one line, for a
    folder that is not one or a dump.json that is damaged or foreign."""
    runs = []
    for step, rank, dump_json in dump_jsons(path):
        try:
            with open(dump_json, encoding="utf-8") as fh:
                doc = json.load(fh)
        except (OSError, ValueError) as exc:
            raise UserError(f"{dump_json}: cannot read it as msprobe's dump.json "
                            f"({type(exc).__name__})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
            raise UserError(f"{dump_json}: not an msprobe dump.json (no 'data' table)")
        if doc.get("framework", "pytorch") != "pytorch":
            raise UserError(f"{dump_json}: a {doc.get('framework')} dump; only PyTorch dumps "
                            "are read")
        run = MsprobeRun(path=os.path.dirname(dump_json), step=step, rank=rank,
                         task=str(doc.get("task", "")), level=str(doc.get("level", "")))
        for name, entry in doc["data"].items():
            found = MODULE_NAME.match(name)
            if not found and isinstance(entry, dict):
                run.api_calls[_record_kind(name)] += 1
            if found and isinstance(entry, dict):
                args = entry.get("input_args")
                kwargs = entry.get("input_kwargs")
                run.calls.append(ModuleCall(
                    found["module"], found["cls"], int(found["call"]),
                    outputs=_tensors(entry.get("output")),
                    args=[a if _is_tensor(a) else None for a in args]
                    if isinstance(args, list) else [],
                    kwargs={k: v for k, v in kwargs.items() if _is_tensor(v)}
                    if isinstance(kwargs, dict) else {}))
        runs.append(run)
    if not runs:
        raise UserError(f"{path}: no msprobe dump.json found (step*/rank*/dump.json)")
    return runs


def dump_jsons(path: str) -> list[tuple[int, int | None, str]]:
    """(step, rank, dump.json) of each run under ``path``: the dump's folder, one of its step
    folders or one of its rank (process) folders."""
    path = os.path.normpath(path)
    name, parent = os.path.basename(path), os.path.basename(os.path.dirname(path))
    if os.path.isfile(os.path.join(path, "dump.json")):
        run, step = RUN_FOLDER.match(name), STEP_FOLDER.match(parent)
        rank = _rank(run)
        return [(int(step[1]) if step else 0, rank, os.path.join(path, "dump.json"))]
    if STEP_FOLDER.match(name):
        return _runs_of_step(path, int(STEP_FOLDER.match(name)[1]))
    try:
        steps = os.listdir(path)
    except OSError:
        return []
    out = [run for step_name in steps if STEP_FOLDER.match(step_name)
           for run in _runs_of_step(os.path.join(path, step_name),
                                    int(STEP_FOLDER.match(step_name)[1]))]
    return sorted(out, key=lambda t: (t[0], -1 if t[1] is None else t[1]))


def _runs_of_step(folder: str, step: int) -> list[tuple[int, int | None, str]]:
    out = []
    for run_name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        run = RUN_FOLDER.match(run_name)
        dump_json = os.path.join(folder, run_name, "dump.json")
        if run and os.path.isfile(dump_json):
            out.append((step, _rank(run), dump_json))
    return sorted(out, key=lambda t: -1 if t[1] is None else t[1])


def _rank(run: re.Match | None) -> int | None:
    """The rank a rank<N> folder names; None for proc<pid> and a plain "rank" folder."""
    return int(run[2]) if run and run[1] == "rank" and run[2] else None


def runs_without_dump_json(path: str) -> list[str]:
    """The rank/proc folders of the msprobe dump at ``path`` that hold files but no dump.json
    (a run cut short before msprobe wrote it): left out of the comparison."""
    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, "dump.json")):
        return []
    steps = [path] if STEP_FOLDER.match(os.path.basename(path)) else [
        os.path.join(path, n) for n in sorted(_listdir(path)) if STEP_FOLDER.match(n)]
    return [os.path.join(step, n) for step in steps for n in sorted(_listdir(step))
            if RUN_FOLDER.match(n) and os.path.isdir(os.path.join(step, n))
            and not os.path.isfile(os.path.join(step, n, "dump.json"))
            and _listdir(os.path.join(step, n))]


def msprobe_dumps_below(path: str, depth: int = 3) -> list[str]:
    """The msprobe dumps in the folders below ``path`` (down to ``depth`` levels; not inside a
    dump): a folder that holds several, e.g. one per device."""
    found, level = [], [path]
    for _ in range(depth):
        below = []
        for folder in level:
            for name in sorted(_listdir(folder)):
                child = os.path.join(folder, name)
                if not os.path.isdir(child):
                    continue
                (found if is_msprobe_dump(child) else below).append(child)
        level = below
    return found


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _is_tensor(value) -> bool:
    return isinstance(value, dict) and value.get("type") == "torch.Tensor"


def _tensors(value) -> list[dict]:
    """The tensor entries of an output, in order (a tensor, a list or tuple of them, a model
    output recorded by field)."""
    if _is_tensor(value):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return [t for item in value for t in _tensors(item)]
    return []
