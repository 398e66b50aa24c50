"""Dump files found under a path and inspected once, for every compare mode.

``find_sources`` lists the dump files of a folder (or one file), opens each once and keeps what
the modes plan with: names, rounds, records, rank and pid, dtype, whether it finished. The
readers stay open in this process (``readers.open_reader``) for the tasks that run here; worker
processes open their own.
"""

from __future__ import annotations

import calendar
import contextlib
import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError, first_line
from ..format import schema as s
from ..format.blocks import clean_block_records, clean_site_records, first_rows
from ..format.coverage import partial_lines, shortfall_lines
from ..format.msprobe import is_msprobe_dump, msprobe_dumps_below, runs_without_dump_json
from ..format.reader import DumpError, DumpReader, find_dump_files
from .readers import open_reader

# Status of an input file (the "status" column of every file table).
OK = "ok"
INCOMPLETE = "incomplete"  # capture cut short: the rounds written were used
SKIPPED = "skipped"  # unreadable or empty: listed with the reason, not used

STACK_MODULE = "(stack input)"
# fp32 matmuls run in a shorter format (meta float32_matmul): the precision rounding is judged by
REDUCED_FP32 = {"high": "float16", "medium": "bfloat16"}  # TF32/HF32 keep fp16's 10-bit mantissa


@dataclass(eq=False)
class DumpFile:
    """One dump file as found: its identity, what it holds, and whether it can be used."""

    path: str
    source: str  # the path relative to the folder compared (the report's "source")
    status: str = OK  # OK, INCOMPLETE (capture cut short; the rounds written are used), SKIPPED
    reason: str = ""  # why not OK, one line
    rank: int | None = None
    pid: int | None = None
    host: str = ""  # the machine that wrote it (meta.host; a container's own name)
    layers: list[str] = field(default_factory=list)  # block module names, by layer number
    sites: list[str] = field(default_factory=list)  # sub-layer module names, by site number
    site_roles: list[str] = field(default_factory=list)  # linear, norm, ... (older dumps: none)
    device: str = ""  # the device type the model ran on (cpu, cuda, npu), "" when unknown
    model_class: str = ""  # the captured model's class (meta.model_class), "" when unknown
    model_layers: int | None = None  # its config's layer count (meta.model_config), if said
    model_type: str = ""  # its config's model_type (llama, gemma3_text...), "" when unknown
    capture_notes: list[str] = field(default_factory=list)  # what capture could not record
    program_error: str = ""  # the exception that ended the program while captured, one line
    data_notes: list[str] = field(default_factory=list)  # those of them on recorded outputs
    # evidence families the capture options asked for and did not get (format/coverage.py)
    missing_evidence: list[str] = field(default_factory=list)
    rounds: np.ndarray = field(default_factory=lambda: np.zeros(0, s.ROUND_DTYPE))
    records: np.ndarray = field(default_factory=lambda: np.zeros(0, s.RECORD_DTYPE))
    clean_blocks: dict[tuple[int, int], int] = field(default_factory=dict)  # (round, layer) ->
    # index into records of the clean block output (rounds without a /rounds row left out)
    clean_sites: dict[tuple[int, int], int] = field(default_factory=dict)  # (round, site) ->
    # index into records of the clean output of a sub-layer or operator
    site_layers: dict[int, int] = field(default_factory=dict)  # site -> its layer
    masks: dict[int, int] = field(default_factory=dict)  # round -> its KIND_MASK record
    # round -> the hash of every input id of its sample up to it, captured steps or not
    # (status "histories", capture/history.py; none in dumps before 2026-11-30, msprobe's)
    histories: dict[int, int] = field(default_factory=dict)
    stats_index: np.ndarray | None = None  # a stats dump's /stats index (None: tensors)
    # (round, layer, site) -> row of /stats, for the outputs a statistics-only file (converted
    # from msprobe's statistics mode) has no tensor of
    summary_rows: dict[tuple[int, int, int], int] = field(default_factory=dict)
    # (round, layer, site) -> row of /stats of a stats dump (--store stats): the whole output's
    # moments, compared with a statistics-only side instead of the few rows it keeps (set by
    # the baseline mode)
    whole_rows: dict[tuple[int, int, int], int] = field(default_factory=dict)
    origin: str = ""  # the msprobe dump a converted file was made of ("" for srdd's own)
    capture_options: dict = field(default_factory=dict)  # its options (meta.dump_config)
    hidden_dtype: str = "float32"  # logical dtype of the hidden states
    compute_dtype: str = ""  # autocast dtype the model ran under ("" when none)
    data_dtypes: list[str] = field(default_factory=list)  # logical dtype of each /data set
    samples: int = 0
    sharded_layers: set[int] = field(default_factory=set)  # tensor parallel: blocks whose
    # output is this rank's part only (meta tensor_parallel.sharded_sites)

    @property
    def usable(self) -> bool:
        return self.status != SKIPPED

    def module(self, layer: int | None, site: int = s.BLOCK_SITE) -> str:
        """Module name of a block (``site`` BLOCK_SITE) or sub-layer; "" when unknown."""
        if layer is None:
            return ""
        if site != s.BLOCK_SITE:
            return self.sites[site] if 0 <= site < len(self.sites) else ""
        if layer == s.STACK_INPUT:
            return STACK_MODULE
        return self.layers[layer] if 0 <= layer < len(self.layers) else ""

    def block_dtype(self) -> str:
        """Logical dtype of the first clean block-output record."""
        if not self.clean_blocks:
            return self.hidden_dtype
        rec = self.records[next(iter(self.clean_blocks.values()))]
        return self.data_dtypes[int(rec["data"])]


ALL_RUNS = "all"


@dataclass
class Sources:
    """The dump files of the run compared, inspected, and what the choice of run was."""

    files: list[DumpFile]
    note: str = ""  # one line when the folder held several runs and one was chosen


def find_sources(path: str, option: str = "", run: str | None = None) -> Sources:
    """The dump files (``*.h5``, ``*.h5.partial``) under ``path``, inspected; one run of each
    folder that holds several.

    ``srdd-dump`` writes each run into its own ``srdd_dump_<UTC time>`` folder. Where one folder
    holds several such runs (``srdd-dump -o dumps/`` run again), only the newest (by its files'
    modification times) is used, and ``note`` says so; dump files lying in that folder itself
    (an older flat dump) count as one more run there. Runs in different folders (one per host
    or card, arranged by hand) are all used: they are the sources of one comparison. ``run``
    names the run(s) to use instead (folder name, or path relative to ``path``), or is "all".
    ``option`` names the command-line option that gave the path, for messages."""
    paths, root, note = locate(path, option, run)
    return inspect_all(paths, root, note)


def locate(path: str, option: str = "", run: str | None = None, convert: bool = True
           ) -> tuple[list[str], str, str]:
    """The dump files ``find_sources`` inspects, the folder their sources are named from and
    its note, without opening any. ``convert`` False: None for an msprobe dump not yet
    converted (``find_sources`` converts it)."""
    if not os.path.exists(path):
        raise UserError(f"{option}{path}: no such file or directory")
    if os.path.basename(path) == "dump.json" and os.path.isfile(path):
        path = os.path.dirname(path) or "."  # msprobe's compare takes the dump.json: its folder
    if os.path.isfile(path) and not _hdf5(path) and zipfile.is_zipfile(path):  # torch.save's
        folder = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        where = f", {folder}" if is_msprobe_dump(folder) else " (the one holding dump.json)"
        raise UserError(f"{option}{path}: a saved torch tensor, not a dump: give the msprobe "
                        f"dump's folder{where}")
    given, notes = path, []
    if os.path.isdir(path) and not find_dump_files(path) and is_msprobe_dump(path):
        if not convert:
            return [], "", ""
        try:
            path = msprobe_as_srdd(path)
        except UserError as exc:
            raise UserError(f"{option}{given}: {exc}") from None
        cut = runs_without_dump_json(given)
        if cut:
            notes.append(f"{len(cut)} msprobe run folder(s) without dump.json left out (a run "
                         f"cut short?): {', '.join(cut[:3])}{' ...' if len(cut) > 3 else ''}")
    found = find_dump_files(path)
    below = msprobe_dumps_below(given) if os.path.isdir(given) and path == given else []
    if not found:
        if below:
            raise UserError(f"{option}{path}: no srdd dump files; msprobe dumps are in "
                            f"{', '.join(below[:4])}{' ...' if len(below) > 4 else ''}: give "
                            "one of those folders")
        parent = os.path.dirname(os.path.normpath(path))
        if os.path.basename(os.path.normpath(path)) == "dump_tensor_data" and \
                is_msprobe_dump(parent):
            raise UserError(f"{option}{path}: the tensor files of an msprobe dump: give its "
                            f"folder, {parent}")
        cut = runs_without_dump_json(path) if os.path.isdir(path) else []
        if cut:
            raise UserError(f"{option}{path}: msprobe run folders without their dump.json (a "
                            f"run cut short, or a copy without it): {', '.join(cut[:3])}"
                            f"{' ...' if len(cut) > 3 else ''}; srdd-compare reads a tensor "
                            "file by its dump.json entry")
        raise UserError(f"{option}{path}: no dump files (*.h5 or *.h5.partial) found")
    if below:
        notes.append(f"msprobe dump(s) in {', '.join(below[:4])} not read with the srdd dumps "
                     "beside them: give such a folder on its own")
    root = path if os.path.isdir(path) else os.path.dirname(path)
    found, note = _choose_runs(given, root, found, option, run)
    return found, root, "; ".join(filter(None, [note, *notes]))


def inspect_all(paths: list[str], root: str, note: str = "") -> Sources:
    """``locate``'s files inspected."""
    return Sources(list(inspected(paths, root)), note)


def inspected(paths: list[str], root: str) -> Iterator[DumpFile]:
    """``locate``'s files inspected one by one, in order."""
    for f in paths:
        yield inspect(f, os.path.relpath(f, root) if root else f)


def msprobe_as_srdd(path: str) -> str:
    """The folder of srdd files made from the msprobe dump at ``path`` (format/from_msprobe.py),
    made once and kept in the temporary folder, named by the dump."""
    # here, not at the top: the converter and the dump writer it uses are 10 ms of imports
    # that every compare of srdd's own dumps would pay before its workers start
    from ..format.from_msprobe import cache_folder, convert

    folder = cache_folder(path, cache_root())
    _prune_cache(folder)
    if not find_dump_files(folder):
        partial = folder + f".{os.getpid()}.tmp"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            convert(path, partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        try:
            os.replace(partial, folder)
        except OSError:  # another process made it meanwhile
            shutil.rmtree(partial, ignore_errors=True)
    return folder


CACHE_DAYS = 7  # a converted dump not read for this long is removed from the cache


def _prune_cache(folder: str) -> None:
    """Mark ``folder`` used; remove the conversions of earlier versions of the same dump (the
    same place, other contents) and any not read for CACHE_DAYS."""
    root, name = os.path.split(folder)
    place = name.rsplit("-", 1)[0] + "-"
    old = time.time() - CACHE_DAYS * 86400
    with contextlib.suppress(OSError):
        os.utime(folder)
    try:
        entries = os.listdir(root)
    except OSError:
        return
    for entry in entries:
        if entry == name or not entry.startswith("msprobe-") or entry.endswith(".tmp"):
            continue
        path = os.path.join(root, entry)
        try:
            stale = entry.startswith(place) or os.stat(path).st_mtime < old
        except OSError:
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)


def cache_root() -> str:
    """This user's folder for converted dumps (mode 700); a fresh one when the usual one
    belongs to someone else."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    root = os.path.join(tempfile.gettempdir(), f"srdd-compare-msprobe-{uid}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    if hasattr(os, "getuid") and os.stat(root).st_uid != uid:
        return tempfile.mkdtemp(prefix="srdd-compare-msprobe-")
    return root


def _run_of(root: str, file: str) -> tuple[str, str]:
    """(the run folder of a dump file, the folder in which it competes with other runs). A run
    written inside another run's folder (``srdd-dump -o <run folder>``) competes with that
    run: they are two runs, not two cards of one."""
    folder = os.path.relpath(os.path.dirname(file) or ".", root or ".")
    parts = [] if folder == "." else folder.split(os.sep)
    runs = [i for i, part in enumerate(parts) if part.startswith(s.RUN_PREFIX)]
    if runs:
        return os.path.join(*parts[: runs[-1] + 1]), os.path.join(*parts[: runs[0]] or ".")
    return folder, folder  # not in a run folder: the files of its own folder are one run


def _choose_runs(path: str, root: str, found: list[str], option: str, run: str | None
                 ) -> tuple[list[str], str]:
    runs: dict[str, list[str]] = {}
    place: dict[str, str] = {}
    for f in found:
        key, where = _run_of(root, f)
        runs.setdefault(key, []).append(f)
        place[key] = where
    # runs keep the files in their found (sorted) order
    if run == ALL_RUNS:
        return found, ""
    if run is not None:
        name = os.path.normpath(run.strip()).strip("/")  # ./run, run/ and run name one run
        picked = [k for k in runs if name in (k, os.path.basename(k))]
        if not picked:
            flag = "--baseline-run" if option.startswith("--baseline") else "--run"
            inside = os.path.join(path, name)
            folder = (f"; {inside} is a folder: give it as the path (an msprobe dump's step "
                      "or rank folder is no run)" if os.path.isdir(inside) else "")
            raise UserError(f"{flag} {run}: no run of that name under {option}{path}; runs: "
                            f"{_names(runs)}{folder}")
        return [f for k in picked for f in runs[k]], ""
    competing: dict[str, list[str]] = {}
    for key, where in place.items():
        competing.setdefault(where, []).append(key)
    keep, notes = set(), []
    for where, keys in competing.items():
        # a run folder's name holds its UTC start time, which copies keep (scp, cp without -p
        # give every file a new modification time); files outside run folders: file times
        newest = max(keys, key=lambda k: (_started(k, runs[k]), k))
        keep.add(newest)
        if len(keys) > 1:
            others = [k for k in keys if k != newest]
            shown = os.path.normpath(os.path.join(path, where)) if where != "." else path
            n = len(runs[newest])
            flag = "--baseline-run" if option.startswith("--baseline") else "--run"
            notes.append(f"{option}{shown} holds {len(keys)} runs; comparing the newest, "
                         f"{_names([newest])} ({n} file{'s' if n > 1 else ''}); "
                         f"{flag} NAME for another ({_names(others)}) or {flag} all")
    apart = _started_apart([(k, runs[k]) for k in runs if k in keep])
    if apart:
        flag = "--baseline-run" if option.startswith("--baseline") else "--run"
        notes.append(f"{option}{path}: the runs compared together as one run's cards, "
                     f"{_names(k for k in runs if k in keep)}, started {apart} apart (separate "
                     f"runs?); {flag} NAME compares one")
    return [f for key, files in runs.items() if key in keep for f in files], "; ".join(notes)


SAME_RUN_SPAN = 600.0  # s: the cards of one run (a launcher on each host) start within this


def _started_apart(runs: list[tuple[str, list[str]]]) -> str:
    """How far apart the runs of different folders started ("2.0 h"), when more than
    SAME_RUN_SPAN: likely separate experiments, not one run's hosts; "" otherwise."""
    if len(runs) < 2:
        return ""
    starts = [_started(k, files) for k, files in runs]
    span = max(starts) - min(starts)
    if span <= SAME_RUN_SPAN:
        return ""
    return f"{span / 3600:.1f} h" if span >= 3600 else f"{span / 60:.0f} min"


def _names(runs) -> str:
    """The runs as --run takes them: a run folder's name, "." for the files of the folder
    itself."""
    names = [os.path.basename(k) if k != "." else "." for k in runs]
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _started(run: str, files: list[str]) -> float:
    """When a run started: the UTC time in a run folder's name (``srdd_dump_<time>[_n]``,
    kept by copies), else its newest file's modification time."""
    name = os.path.basename(run)
    if name.startswith(s.RUN_PREFIX):
        stamp = name[len(s.RUN_PREFIX):][:15]
        with contextlib.suppress(ValueError, OverflowError):
            return calendar.timegm(time.strptime(stamp, s.RUN_TIME_FORMAT))
    return max(_mtime(f) for f in files)


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


# a model config's layer count, by the names configs give it (Llama, GPT-2, Falcon...)
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")

# the status counters of what a capture left out, and what each means
LEFT_OUT = {
    "host_replays_failed": "module replays on the host failed (a device-only kernel or "
    "offloaded weights): those modules have no host reference",
    "records_dropped": "outputs were not shaped like the round's tokens (routed experts, "
    "per-head tensors such as a q_norm / k_norm) and were left out",
    "site_errors": "sub-layer or operator captures failed and were skipped",
    "tp_replays_skipped": "replays of tensor-parallel modules were skipped (a replay would "
    "communicate with the other ranks): those modules have clean data only",
    "tp_host_replays_skipped": "host replays of tensor-parallel modules were skipped (a host "
    "copy of one rank's shard is not the module): no host reference",
    "compiled_probes_dropped": "module replays ran as torch.compile'd code that an eager replay "
    "does not reproduce: those modules have no probe records there",
    "sites_never_run": "blocks or sub-layers never ran their capture hooks (torch.compile'd code "
    "compiled before the hooks were registered) and have no records",
    "tensors_unreadable": "tensor files of the msprobe dump could not be read (a copy cut "
    "short?) and were left out",
    "msprobe_not_read": "records of the msprobe dump are not compared (srdd-compare reads the "
    "blocks, their attention and MLP, Linear and *Norm modules; not API calls or other "
    "modules)",
    "msprobe_inputs_changed": "recorded block inputs (msprobe, a block and round each) differ "
    "from the output of the block before them (something between the two modules changes "
    "the stream: code outside the blocks, or a hook run after msprobe's); the layer-by-layer "
    "reading takes a block's input to be the last block's output, so such a change is named "
    "at the block it feeds",
}
# those on recorded outputs, not on probes: a baseline says them too
DATA_LEFT_OUT = ("records_dropped", "site_errors", "sites_never_run", "tensors_unreadable",
                 "msprobe_not_read", "msprobe_inputs_changed")


def data_notes(source: str, status: dict) -> list[str]:
    """The notes of ``capture_notes`` on outputs the file does not hold."""
    return _left_out(source, status, DATA_LEFT_OUT)


def _left_out(source: str, status: dict, keys) -> list[str]:
    """A line per counter of ``keys`` the file's ``status`` holds above 0, with the sites."""
    notes = []
    for key in keys:
        n = status.get(key) if isinstance(status, dict) else None
        if isinstance(n, int) and n > 0:
            names = status.get(f"{key}_sites")  # the sites left out, by name (since 2026-11-28)
            which = f": {', '.join(map(str, names))}" if isinstance(names, list) and names else ""
            notes.append(f"{source}: {n} {LEFT_OUT[key]}{which}")
    return notes


def capture_notes(source: str, status: dict) -> list[str]:
    """One line per thing the capture of a file had to leave out (its ``status`` counters)."""
    notes = _left_out(source, status, LEFT_OUT)
    if isinstance(status, dict):
        ended = status.get("program_error")
        if isinstance(ended, str) and ended.startswith(s.WITH_BLOCK_LEFT):
            notes.append(f"{source}: the capture ended when {first_line(ended)}: the rounds "
                         "before it are compared")
        elif isinstance(ended, str) and ended.startswith("stopped by ") \
                and status.get("requests"):
            notes.append(f"{source}: the serving engine was {first_line(ended)} (a server's "
                         "usual end): the rounds finished before it are compared")
        elif isinstance(ended, str) and ended:
            notes.append(f"{source}: the program ended while capturing "
                         f"({first_line(ended)}): the rounds before it are compared")
        notes += [f"{source}: {line}" for line in partial_lines(status.get("coverage"))]
        untested = status.get("untested_versions")
        notes += [f"{source}: {n}" for n in untested or [] if isinstance(n, str)]
    assumed = status.get("assumed_activations") if isinstance(status, dict) else None
    for what in assumed or []:
        notes.append(f"{source}: the reference MLP took act_fn {what} (its class has no "
                     "formula here): an activation kernel of another formula differs from it "
                     "in every layer (a SYSTEMIC MLP_MISMATCH)")
    stopped = status.get("tp_lockstep_stopped") if isinstance(status, dict) else None
    if stopped:
        notes.append(f"{source}: lockstep replays stopped ({stopped}); the tensor-parallel "
                     "modules' later rounds have clean data only")
    return notes


def missing_evidence(source: str, status: dict) -> list[str]:
    """What the verdicts of a file cannot rest on: the evidence families its capture asked
    for and got on too few calls (``coverage`` in its status), one line per cause. A file
    written before coverage was recorded: its skipped decode replays, if any."""
    if not isinstance(status, dict):
        return []
    if isinstance(status.get("coverage"), dict):
        return [f"{source}: {line}" for line in shortfall_lines(status["coverage"])]
    skipped = status.get("decode_replays_skipped")
    if isinstance(skipped, int) and skipped > 0:
        return [f"{source}: decode steps not probed on {skipped} calls (a KV cache layout "
                "not reproduced)"]
    return []


def _shown(path: str) -> str:
    """A folder as a report names it: relative to the current folder when inside it (two
    dumps of one name in two folders stay apart), else whole."""
    if not path:
        return ""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _histories(status: dict, rounds: np.ndarray) -> dict[int, int]:
    """round -> its token history hash, from the status's [sample, step, hash] entries."""
    entries = status.get("histories") if isinstance(status, dict) else None
    if not isinstance(entries, list):
        return {}
    by_key = {(int(r["sample"]), int(r["step"])): int(r["round"]) for r in rounds}
    out = {}
    for entry in entries:
        if (isinstance(entry, list) and len(entry) == 3 and all(isinstance(v, int) for v in entry)
                and (entry[0], entry[1]) in by_key):
            out[by_key[(entry[0], entry[1])]] = entry[2]
    return out


def inspect(path: str, source: str) -> DumpFile:
    """What a dump file holds; a file that cannot be opened becomes SKIPPED with the reason."""
    f = DumpFile(path=path, source=source)
    try:
        reader = open_reader(path)
    except DumpError as exc:
        f.status, f.reason = SKIPPED, str(exc)
        return f
    f.rank, f.pid = reader.meta_int("rank"), reader.meta_int("pid")
    f.host = str(reader.meta.get("host") or "")
    f.layers, f.sites = list(reader.layers), list(reader.sites)
    roles = reader.meta.get("site_roles")
    f.site_roles = [str(r) for r in roles] if isinstance(roles, list) else []
    f.device = str(reader.meta.get("device") or "").split(":")[0]
    # a class of the main script is __mp_main__'s in a spawned child: the same class
    f.model_class = str(reader.meta.get("model_class") or "").replace("__mp_main__.",
                                                                        "__main__.")
    config = reader.meta.get("model_config")
    layers = next((config[k] for k in LAYER_COUNT_KEYS if isinstance(config, dict)
                   and isinstance(config.get(k), int)), None)
    f.model_layers = layers
    kind = config.get("model_type") if isinstance(config, dict) else None
    f.model_type = kind if isinstance(kind, str) else ""
    options = reader.meta.get("dump_config")
    f.capture_options = options if isinstance(options, dict) else {}
    if reader.meta.get("tool") == "msprobe":
        f.origin = str(reader.meta.get("source_dump") or "")
        # named by the user's msprobe folder, not the file converted from it in a cache
        part = os.path.basename(path).removeprefix("msprobe_").removesuffix(s.FILE_SUFFIX)
        f.source = source = f"{_shown(f.origin) or 'msprobe'} ({part})"
    f.capture_notes = capture_notes(source, reader.status)
    ended = reader.status.get("program_error") if isinstance(reader.status, dict) else None
    f.program_error = first_line(ended) if isinstance(ended, str) else ""
    f.data_notes = data_notes(source, reader.status)
    f.missing_evidence = missing_evidence(source, reader.status)
    if f.origin:  # msprobe asked for no probe: what it lacks is a note, not evidence missing
        f.capture_notes += f.missing_evidence
        f.missing_evidence = []
    tp = reader.meta.get("tensor_parallel")
    sharded = tp.get("sharded_sites") if isinstance(tp, dict) else None
    if isinstance(sharded, dict) and sharded:
        f.sharded_layers = {i for i, name in enumerate(f.layers) if name in sharded}
        f.capture_notes.append(
            f"{source}: {len(sharded)} sites hold rank {tp.get('rank')}'s part only (tensor "
            f"parallel over {tp.get('world_size')} ranks; e.g. {next(iter(sharded))}): judged "
            "on that part")
    f.rounds, f.records = reader.rounds, reader.records
    f.samples = reader.n_samples
    f.clean_blocks = clean_block_records(reader)
    f.clean_sites, f.site_layers = clean_site_records(reader)
    if reader.has_stats:
        f.stats_index = reader.stats_index
        if reader.meta.get("statistics_only"):
            index = reader.stats_index
            f.summary_rows = first_rows(reader.rounds, index, np.ones(len(index), dtype=bool),
                                        ("round", "layer", "site"))
            f.site_layers = {**{site: layer for _, layer, site in f.summary_rows
                                if site >= 0}, **f.site_layers}
    r = reader.records
    f.masks = {int(r["round"][i]): int(i) for i in np.flatnonzero(r["kind"] == s.KIND_MASK)}
    f.histories = _histories(reader.status, f.rounds)
    f.data_dtypes = reader.data_dtypes
    clean = reader.select(kind=s.KIND_CLEAN)
    first = reader.dtype_of(clean[0]) if len(clean) else "float32"
    if not len(clean) and len(reader.stats_index):
        first = s.DTYPE_CODES[int(reader.stats_index["dtype"][0])]
    f.hidden_dtype = str(reader.meta.get("hidden_dtype") or first)
    f.compute_dtype = str(reader.meta.get("autocast_dtype") or "") or REDUCED_FP32.get(
        str(reader.meta.get("float32_matmul") or ""), "")
    if not reader.complete:
        f.status, f.reason = INCOMPLETE, incomplete_reason(reader)
        f.capture_notes.append(f"{f.source}: {f.reason}")
    return f


def incomplete_reason(reader: DumpReader) -> str:
    if reader.path.endswith(s.PARTIAL_SUFFIX):
        why = "capture did not finish (.partial file)"
    else:
        why = "capture did not finish cleanly"
    error = reader.status.get("error") or reader.status.get("write_error")
    if error:
        why += f": {first_line(error)}"
    unknown = ("" if isinstance(reader.status, dict) and "coverage" in reader.status else
               "; the evidence its capture could not get is counted at the end: unknown here")
    return f"{why}; the {len(reader.rounds)} rounds written were used{unknown}"


def no_usable_file(reasons: list[str], path: str, option: str = "", under: bool = False
                   ) -> UserError:
    """The error for a path none of whose dump files can be used (``reasons``: one per file)."""
    if len(reasons) == 1:
        return UserError(reasons[0])
    if under:
        return UserError(f"none of the {len(reasons)} dump files under {path} is usable; "
                         f"{reasons[0]}")
    return UserError(f"{option}{path}: none of the {len(reasons)} dump files is usable; "
                     f"{reasons[0]}")


def _hdf5(path: str) -> bool:
    """The file starts with HDF5's signature (a dump: never read as a zip by chance)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(8) == b"\x89HDF\r\n\x1a\n"
    except OSError:
        return False
