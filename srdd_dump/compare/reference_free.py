"""Reference-free mode: the signals of every block and sub-layer of each dump file, then one
verdict row per block layer (``analysis.diagnosis``).

Tasks (``signal_reader.SignalTask``, planned by ``early.plan``) are runs of consecutive layers
of one file (the whole file with one process), so the processes of ``-j N`` share the files
and the layers in them.
"""

from __future__ import annotations

import math

import numpy as np

from ..analysis.diagnosis import (
    RELATIVE_MIN_LAYERS,
    LayerVerdict,
    diagnose,
    headline,
    site_verdicts,
)
from ..analysis.signals import DECODE, PREFILL, Signals, set_kurtosis_change
from ..analysis.verdicts import FAULT, NORMAL, VERDICT_ORDER
from ..format import schema as s
from ..format.layer_numbers import after_gap, layer_numbers, number_of
from ..vocabulary import CORE, EXPERT, sublayer_kind
from .hunt import hunt_command
from .results import (
    FILE_COLUMNS,
    LAYER_COLUMNS,
    OK,
    SITE_COLUMNS,
    SKIPPED,
    CompareResult,
)
from .signal_reader import SignalTask
from .sources import DumpFile
from .table import Table


def finish(path: str, files: list[DumpFile], tasks: list[SignalTask],
           results: list[list[Signals] | str]) -> CompareResult:
    """Diagnose each file from its tasks' signals; files without layer data become SKIPPED."""
    per_file: dict[int, list[Signals]] = {}
    failed: dict[int, str] = {}
    for task, result in zip(tasks, results):
        if isinstance(result, str):
            failed.setdefault(task.file, result)
        else:
            per_file.setdefault(task.file, []).extend(result)
    layer_rows, site_rows, file_rows, headlines, hunts, notes = [], [], [], [], [], []
    hunt_of: dict[int, str] = {}
    for n, f in enumerate(files):
        counts = dict(rounds=len(f.rounds), samples=f.samples, rank=f.rank, pid=f.pid)
        if not f.usable:
            file_rows.append(_file_row(f.source, SKIPPED, f.reason, rank=f.rank, pid=f.pid))
            continue
        if n in failed:
            f.status, f.reason = SKIPPED, failed[n]  # the later steps (consistency) skip it too
            file_rows.append(_file_row(f.source, SKIPPED, failed[n], rank=f.rank, pid=f.pid))
            continue
        signals = sorted(per_file.get(n, []), key=lambda g: (g.layer, g.site, g.phase))
        set_kurtosis_change(signals, after_gap(layer_numbers(f.layers)))
        notes += unprobed_experts(f.source, signals)
        whole = holds_every_block(f)
        if len(f.layers) > 1 and not whole:  # one block: nothing to compare
            notes.append(part_note(f))
        rows, sites, line, hunt = _diagnose_file(f, signals, whole)
        layer_rows += rows
        site_rows += sites
        if line:
            headlines.append(line)
        if hunt and hunt not in hunts:
            hunts.append(hunt)
            if line:
                hunt_of[len(headlines) - 1] = hunt
        if not rows:
            why = "no captured layer data" + ("" if f.status == OK else " (incomplete file)")
            if f.origin:
                why = (f"{f.origin}: the msprobe dump holds no block output, which the "
                       "reference-free diagnosis judges (add the decoder layer class to "
                       "msprobe's list), or compare its modules with --baseline")
            else:
                why = f"{f.path}: {why}"
            file_rows.append(_file_row(f.source, SKIPPED, why, layers=0, **counts))
        else:
            file_rows.append(_file_row(f.source, f.status, f.reason, layers=len(rows), **counts))
    return CompareResult(
        path=path, layers=layers_table(layer_rows), files=files_table(file_rows),
        sites=sites_table(site_rows), headlines=headlines, hunts=hunts, hunt_of=hunt_of,
        notes=notes,
    )


UNPROBED_SHOWN = 4  # experts named in the note, the rest counted


def unprobed_experts(source: str, signals: list[Signals]) -> list[str]:
    """A line naming the experts that got tokens but none of the probed samples' rows (their
    gain, dc and repeats unmeasured: judged on their outputs alone), where other sites were
    probed. The router picks an expert's tokens: probing more samples reaches more experts."""
    if not any(g.probed_samples for g in signals):
        return []
    idle = sorted({g.module for g in signals if g.role == EXPERT and g.samples}
                  - {g.module for g in signals if g.role == EXPERT and g.probed_samples})
    if not idle:
        return []
    shown = ", ".join(idle[:UNPROBED_SHOWN]) + (f" and {len(idle) - UNPROBED_SHOWN} more"
                                                if len(idle) > UNPROBED_SHOWN else "")
    return [f"{source}: {len(idle)} expert{'s' if len(idle) != 1 else ''} got none of the "
            f"probed tokens ({shown}): judged on their outputs alone, without probe "
            "responses; a capture with srdd-dump --probe-samples N probes more samples, whose "
            "tokens reach more experts"]


def holds_every_block(f: DumpFile) -> bool:
    """The dump holds every block of its model's stack: numbered 0, 1, 2, ... without a gap,
    and where its capture named blocks (``--layers``), as many as the config says. (A stack
    found without ``--layers`` is taken whole: a config's count may be another stack's, a
    vision tower's against the text model's.)"""
    numbers = layer_numbers(f.layers)
    if numbers != list(range(len(numbers))):
        return False
    named = bool(f.capture_options.get("layers"))
    return not (named and f.model_layers) or len(f.layers) >= f.model_layers


def part_note(f: DumpFile) -> str:
    of = f" of the model's {f.model_layers}" if f.model_layers else ""
    weaker = ("not made (fewer than 8 blocks)" if len(f.layers) < RELATIVE_MIN_LAYERS else
              "SUSPECT at most")
    return (f"{f.source}: a dump of {len(f.layers)}{of} blocks: the test that compares a "
            "layer's mean offset with the other layers' is weaker there (a part of the model "
            f"is no sample of its layers): {weaker}; capture every layer for the full test")


def _diagnose_file(f: DumpFile, signals: list[Signals], whole: bool = True
                   ) -> tuple[list[dict], list[dict], str, str | None]:
    """Layer rows, sub-layer rows, the headline of one file and the command that hunts the
    operator of its FAULT (compare/hunt.py); ``whole``: ``holds_every_block``."""
    blocks: dict[int, Signals] = {}  # the layer rows: prefill signals, else decode ones
    for g in signals:
        if (g.site == s.BLOCK_SITE and g.samples and g.layer >= 0
                and (g.layer not in blocks or g.phase == PREFILL)):
            blocks[g.layer] = g
    if not blocks:
        return [], [], "", None
    numbers = layer_numbers(f.layers)  # the rows name the model's layers, not file positions
    verdicts = diagnose(signals, f.hidden_dtype, n_layers=max(len(f.layers), max(blocks) + 1),
                        compute_dtype=f.compute_dtype, whole=whole, after_gap=after_gap(numbers))
    experts = {name: int(name.rsplit(".", 1)[1])
               for name, role in zip(f.sites, f.site_roles) if role == EXPERT}
    worst = max(verdicts, key=lambda v: v.score)
    hunt = hunt_command(f, worst.layer, worst.site) if worst.verdict == FAULT else None
    decode = {g.layer: g for g in signals if g.site == s.BLOCK_SITE and g.samples
              and g.layer >= 0 and g.phase == DECODE}
    rows = []
    for v in verdicts:
        position, v.layer = v.layer, number_of(numbers, v.layer)
        if position in blocks:
            # a finding of the decode steps (a decode-only fault) shows their numbers
            main = max(v.evidence, key=lambda e: e.strength) if v.evidence and \
                v.verdict != NORMAL else None
            if main is not None and main.phase == DECODE and position in decode:
                blocks[position] = decode[position]
            v.module = blocks[position].module
            rows.append(layer_row(f.source, blocks[position], v, f.rank, f.pid,
                                  experts.get(v.site)))
    shown = {id(g) for g in blocks.values()}
    judged = site_verdicts(verdicts)
    sites = [site_row(f.source, g, f.rank, f.pid, judged.get((g.module, g.phase)),
                      number_of(numbers, g.layer))
             for g in signals if g.samples and id(g) not in shown and g.layer >= 0]
    if worst.verdict == NORMAL:
        n = max(g.samples for g in blocks.values())
        probed = _probed(signals, n)
        line = (f"{f.source}: no faulty layer found in {len(rows)} "
                f"layer{'s' if len(rows) != 1 else ''} x "
                f"{n} sample{'s' if n != 1 else ''}{probed}"
                + phases_note(signals, int(np.count_nonzero(f.rounds['step'] > 0)),
                              f.program_error)
                + ("" if probed == NONE_PROBED else left_out_note(f.capture_options)))
    else:
        line = f"{f.source}: {headline(worst)}" + between_operators(worst, signals, judged)
    return rows, sites, line, hunt


def between_operators(worst: LayerVerdict, signals: list[Signals],
                      judged: dict[tuple[str, str], tuple[float, str, str]]) -> str:
    """What a FAULT at a sub-layer whose operators were captured with their float64 replays
    (a hunt's dump) adds when every one of them agrees with its replay and shows no fault of
    its own: the fault lies in the computation between them, which no operator replay checks
    (an attention's core: its rotary, scores, softmax, mask and head mapping)."""
    if worst.verdict != FAULT or not worst.site:
        return ""
    inside = [g for g in signals if g.module.startswith(worst.site + ".") and g.samples]
    operators = [g for g in inside if g.role != CORE]
    checked = sorted({g.module for g in operators if np.isfinite(g.host_red)})
    # every operator replayed and agreeing: one not replayed may hold the fault
    if not operators or len(checked) < len({g.module for g in operators}) or any(
            judged.get((g.module, g.phase), (0.0, NORMAL, ""))[1] != NORMAL
            for g in operators):
        return ""
    core = sorted({g.module for g in inside if g.role == CORE})
    kind = next((sublayer_kind(g.role, g.module) for g in signals if g.module == worst.site),
                None)
    where = (f"the attention kernel ({core[0]}: its rotary, scores, softmax, mask or head "
             "mapping)" if kind == "attention" and core else "the computation between them")
    names = ", ".join(m.rsplit(".", 1)[-1] for m in checked)
    return (f"; its operators ({names}) agree with their float64 replays and show no fault "
            f"of their own: the fault is in {where}")


def phases_note(signals: list[Signals], decode_rounds: int = 0, ended: str = "") -> str:
    """What a healthy headline says of the phases judged: the decode steps when any was
    captured (else that none was), and when none of them was probed while the prefill was
    (``--probe-steps 0``, a static cache) or the blocks of only some layers were, or of none
    while their sub-layers were (a sliding-window cache longer than its window). Nothing
    probed at all (an msprobe dump, ``--probes none``) is said once, by the sample count
    ("none probed"). ``decode_rounds``: the decode steps the file records; ``ended``: the
    error that ended the program while it was captured (status ``program_error``)."""
    decode = [g for g in signals if g.phase == DECODE]
    if not decode and decode_rounds:  # their outputs lost (an msprobe copy cut short)
        return (f" (prefill only: {decode_rounds} decode step{'s' if decode_rounds != 1 else ''}"
                " recorded, no output of them read)")
    if not decode and ended.startswith(s.WITH_BLOCK_LEFT):
        return f" (prefill only: no decode step was captured before {ended})"
    if not decode and ended:  # interrupted (Ctrl-C, an error) before its first decode step
        return f" (prefill only: no decode step was captured before the program ended: {ended})"
    if not decode:  # a program of forwards only (an evaluation harness, use_cache=False)
        return " (prefill only: no decode step was captured)"
    # a serving engine's later file may hold steps of requests under way only
    phases = ("decode steps only: no prefill is in this file" if len(decode) == len(signals)
              else "prefill and decode steps")
    if len(decode) < len(signals) and not any(
            g.probed_samples for g in signals if g.phase != DECODE) and any(
            g.probed_samples for g in decode):
        phases += ", prefill unprobed"  # every probed prefill was lost (its forward failed)
    if not any(g.probed_samples for g in decode):
        if not any(g.probed_samples for g in signals):
            return f" ({phases})"
        return f" ({phases}, decode unprobed)"
    blocks = [g for g in decode if g.site == s.BLOCK_SITE and g.layer >= 0]  # no stack input
    probed = sum(1 for g in blocks if g.probed_samples)
    if probed < len(blocks):  # 0 too: the sub-layers of a step may be probed, no block
        return f" ({phases}, decode probed at {probed} of {len(blocks)} layers)"
    return f" ({phases})"


# the probe families a capture may leave out, each as (what the healthy headline calls it, is
# it left out of these capture options): a healthy verdict then says it did not test them
LEFT_OUT = (
    ("noise gain", lambda o, probes: "gain" not in probes or not o.get("draws", 1)
     or not o.get("sigmas", [1])),
    ("dc response", lambda o, probes: "dc" not in probes or not o.get("dc", [1])),
    ("run-to-run repeats", lambda o, probes: "repeat" not in probes or not o.get("repeats", 1)),
    ("causality", lambda o, probes: "causal" not in probes),
    ("host references", lambda o, probes: not {"attention", "mlp", "norm"} & probes
     and o.get("reference", "none") != "host"),
    ("batch dependence", lambda o, probes: o.get("batch_probes") is False),
)
NONE_PROBED = ", none probed"


def left_out_note(options: dict) -> str:
    """"; not tested (left out at capture): run-to-run repeats" for a capture that switched
    off probe families the diagnosis reads (``--repeats 0``, ``--probes gain``): a healthy
    verdict then does not cover the faults only they show. Nothing for the default probes or
    a dump without its options (msprobe's)."""
    text = options.get("probes")
    if not isinstance(text, str):
        return ""
    words = {w.strip() for w in text.lower().split(",")} - {"none", "off", ""}
    left = [name for name, left_out in LEFT_OUT if left_out(options, words)]
    return f"; not tested (left out at capture): {', '.join(left)}" if left else ""


def _probed(signals: list[Signals], samples: int) -> str:
    """", 1 probed" when the probe responses come from fewer samples than were captured (the
    default probes the first sample only: docs/using.md)."""
    probed = max((g.probed_samples for g in signals), default=0)
    if probed >= samples:
        return ""
    return NONE_PROBED if not probed else f", {probed} probed"


# -- tables ------------------------------------------------------------------------------------


def layer_row(source: str, sig: Signals, verdict: LayerVerdict, rank: int | None = None,
              pid: int | None = None, expert: int | None = None) -> dict:
    """A block layer's row: its verdict and its block-level signals (``expert``: the expert
    its site is)."""
    row = {k: v for k, v in sig.as_dict().items() if k in LAYER_COLUMNS}
    row.update(
        source=source, layer=verdict.layer, module=sig.module, score=round(verdict.score, 4),
        verdict=verdict.verdict, diagnosis=verdict.diagnosis, site=verdict.site,
        expert=expert, evidence=verdict.explain(), rank=rank, pid=pid,
    )
    if not sig.samples:
        row["absmax"] = math.nan
    return row


def site_row(source: str, sig: Signals, rank: int | None = None, pid: int | None = None,
             judged: tuple[float, str, str] | None = None, layer: int | None = None) -> dict:
    """A sub-layer or operator row (a block's decode steps too): its signals and the verdict
    of the evidence seen at that module (``layer``: its block's number, if not the signals')."""
    row = {k: v for k, v in sig.as_dict().items() if k in SITE_COLUMNS}
    if layer is not None:
        row["layer"] = layer
    score, verdict, labels = judged or (0.0, NORMAL, "")
    row.update(source=source, rank=rank, pid=pid, score=round(score, 4), verdict=verdict,
               diagnosis=labels,
               expert=int(sig.module.rsplit(".", 1)[1]) if sig.role == EXPERT else None)
    return row


def sites_table(rows: list[dict]) -> Table:
    ordered = sorted(rows, key=lambda r: (r["source"], r["layer"], r["phase"], r["module"]))
    return Table(SITE_COLUMNS, ordered, whole_numbers=("rank", "pid"))


def layers_table(rows: list[dict]) -> Table:
    """Rows sorted most suspicious first: verdict, then score descending, source, layer."""
    def most_suspicious_first(r: dict) -> tuple:
        score = r["score"]
        unscored = score is None or math.isnan(score)  # last, as pandas sorts a NaN
        return (VERDICT_ORDER.get(r["verdict"], len(VERDICT_ORDER)), unscored,
                0.0 if unscored else -score, r["source"], r["layer"])

    return Table(LAYER_COLUMNS, sorted(rows, key=most_suspicious_first),
                 whole_numbers=("rank", "pid"))


def files_table(rows: list[dict]) -> Table:
    return Table(FILE_COLUMNS, rows,
                 whole_numbers=("rounds", "samples", "layers", "rank", "pid"))


def _file_row(source: str, status: str, reason: str, **counts) -> dict:
    return {"source": source, "status": status, "reason": reason, **counts}
