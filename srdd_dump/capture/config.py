"""What to capture: DumpConfig and the parsers of its range options. No torch here."""

from __future__ import annotations

import difflib
import json
import math
import numbers
import os
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple

from ..errors import UserError
from .faultspec import FaultSpec, parse_fault
from .option_names import named_as_flags, option

ENV_CONFIG = "SRDD_DUMP_CONFIG"  # JSON DumpConfig handed to every child Python process
# created in the status folder by srdd-dump when it is sent SIGINT or SIGTERM: every capturing
# process then finishes its file (dump_file.FileWatch)
FINISH_REQUEST = "finish"
ENV_STATUS_DIR = "SRDD_DUMP_STATUS_DIR"  # where child processes report how capture went
EXIT_BAD_OPTIONS = 2  # srdd-dump's exit code for options that do not fit (a process stopped)
PROBE_STEPS = "0,1"  # the default probed steps: the prefill and decode step 1
# defaults of earlier versions: recorded in their dumps, repeated by the hunt commands printed
# for them, and exempt from the check that a probed step is captured as the default is
FORMER_PROBE_STEPS = ("0,1,7",)


@dataclass(frozen=True)
class ParsedOptions:
    """DumpConfig's text options, parsed once (DumpConfig.parsed)."""

    steps: list | None  # parse_steps: inclusive (first, last) ranges; None = every step
    last_step: float  # the last step kept (inf: no end)
    probe_steps: list | None
    tokens: object  # parse_tokens
    probes: frozenset  # parse_probes
    store: StoreSpec


@dataclass
class DumpConfig:
    """Capture settings, in the spirit of msit's ``DumpConfig``.

    dump_path: folder for the dump files (one per process).
    samples: number of samples (prefill forwards, more than one token) to capture.
    steps: forward rounds to keep per sample, as in msit's ``-er``: "0" = prefill only,
        "0,1-4" = prefill and the first four decode steps, "all" = every round.
    tokens: token positions to keep, e.g. "all", "0:16", "-8:" (last 8), "0,5,-1".
    layers: glob over module names that overrides automatic block discovery,
        e.g. "model.layers.*".
    seed: seed of every random choice srdd-dump makes (recorded in the dump).
    probe_steps: which of the captured steps are also probed, in the syntax of ``steps``
        ("all": every captured step; "0": the prefill only).
    probe_samples: each probed step is probed in the first N samples that reach it (default
        1: the first sample, and a decode step it never ran in the next one that does); the
        other rounds are captured without probes, their clean statistics judged (each probed
        sample costs several plain ones: docs/benchmarks.md, "How many samples are probed").
    probes: gain, dc, repeat (replays of perturbed inputs), scale (the linear-map identity,
        at operator granularity), causal (the causality identity of attention and blocks),
        attention, mlp, norm (the host references of the attention and MLP sub-layers, in
        float32 (float64 for a float64 model), and the float64 host replay of the block's
        norms).
    sigmas, draws, dc, repeats: the gain noise sizes (relative to each token's std), noise
        draws per size, dc shifts (in token stds) and unperturbed re-runs; a second, smaller
        sigma adds the reported (not judged) ``linearity``.
    granularity: block, sublayer (attention, MLP and the norms of the block too) or op (every
        operator inside).
    reference: none, or host: each probed site re-run in float64 on the host CPU.
    store: "sample:N" (every clean output, probe outputs on rows of about N elements), "full"
        (probe outputs on every row), or "stats[:R]": no tensors but the statistics the
        reference-free diagnosis needs, reduced on the device, and R seeded rows (default 2)
        of every block output for the baseline mode (docs/dump-format.md).
    tp_replays: under tensor parallelism, "skip" (never replay a module with distributed
        parameters: its replay would communicate) or "lockstep" (replay it on every rank at
        the same point, agreed through the process group's store; capture/parallel.py).
    debug: a capture error (capture is then turned off, the program goes on) also prints its
        traceback on stderr (srdd-dump --debug sets it in the command's processes).
    command, command_dir: set by ``srdd-dump --exec``: the command it ran and the folder it
        ran it from (the hunt command srdd-compare prints runs it again from there).
    """

    dump_path: str = "srdd_dumps"
    samples: int = 8
    steps: str = "0-2,7"
    tokens: str = "all"
    layers: str | None = None
    seed: int = 0
    probes: str = "gain,dc,repeat,scale,causal,attention,mlp,norm"
    probe_steps: str = PROBE_STEPS
    probe_samples: int = 1
    sigmas: list = field(default_factory=lambda: [0.1])
    draws: int = 2
    dc: list = field(default_factory=lambda: [1.0])
    repeats: int = 2
    granularity: str = "sublayer"
    sublayers: str | None = None
    reference: str = "none"
    store: str = "sample:32768"
    inject: list = field(default_factory=list)
    batch_probes: bool = True
    tp_replays: str = "skip"
    progress: bool = True
    debug: bool = False
    command: str | None = None
    command_dir: str | None = None

    def __post_init__(self) -> None:
        with self.naming():
            self._check()

    def naming(self) -> AbstractContextManager[None]:
        """Within: errors name srdd-dump's flags when srdd-dump --exec made this config (the
        command's processes), else the DumpConfig fields."""
        return named_as_flags(self.command is not None)

    def _check(self) -> None:
        self._check_types()
        if self.samples < 1:
            raise UserError(f"{option('samples')} must be at least 1, got {self.samples}")
        self.parsed()
        if self.granularity not in GRANULARITIES:
            raise UserError(f"{option('granularity')} must be one of {', '.join(GRANULARITIES)}, "
                            f"got {self.granularity!r}")
        if self.reference not in REFERENCES:
            raise UserError(f"{option('reference')} must be one of {', '.join(REFERENCES)}, "
                            f"got {self.reference!r}")
        if self.tp_replays not in TP_REPLAYS:
            raise UserError(f"{option('tp_replays')} must be one of {', '.join(TP_REPLAYS)}, "
                            f"got {self.tp_replays!r}")
        if self.probe_samples < 0:
            raise UserError(f"{option('probe_samples')} must be >= 0, got {self.probe_samples}")
        for name in ("draws", "repeats"):
            if getattr(self, name) < 0:
                raise UserError(f"{option(name)} must be >= 0, got {getattr(self, name)}")
        bad = [v for v in self.sigmas if not (math.isfinite(v) and v > 0)]
        if bad:
            raise UserError(f"{option('sigmas')} must be a positive number (a noise size in "
                            f"token stds), got {bad[0]}")
        bad = [v for v in self.dc if not (math.isfinite(v) and v != 0)]
        if bad:  # a shift of 0 is no probe: its dc_dead and dc_low would read 1
            raise UserError(f"{option('dc')} must be a non-zero number (a shift in token "
                            f"stds), got {bad[0] + 0.0:g}")
        if self.reference == "host" and self.probe_samples == 0:
            raise UserError(f"{option('reference')} host replays the probed samples, and "
                            f"{option('probe_samples')} 0 probes none: give 1 or more")
        if self.granularity == "block" and self.sublayers is not None:
            raise UserError(f"{option('sublayers')} names modules inside the blocks, which "
                            f"{option('granularity')} block does not capture: use sublayer or op")
        for name, values in (("sigmas", self.sigmas), ("dc", self.dc)):
            twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
            if twice is not None:  # a second probe of the same size would only cost its replays
                raise UserError(f"{option(name)} {twice + 0.0:g} is given twice; give each value "
                                "once")  # + 0.0: -0 is said as 0
        self.faults()

    def _check_types(self) -> None:
        """A field of the wrong type (``samples="two"``, ``dump_path=123``) is refused by
        name, as the command line would, not met later as a TypeError or a capture turned
        off: each field is checked against its declared type (a path may be a PathLike, a
        numpy integer is an int, a list field given one value is a list of one)."""
        def number(v) -> bool:
            return isinstance(v, numbers.Real) and not isinstance(v, bool)

        for f in fields(self):
            name, value = f.name, getattr(self, f.name)
            if name == "dump_path" and isinstance(value, os.PathLike):
                value = os.fspath(value)
            if f.type == "int":
                if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                    raise UserError(f"{option(name)} must be a whole number, got {value!r}")
                value = int(value)  # a numpy integer, as JSON and the command line have it
            elif f.type == "list":
                item, what = (str, "fault specs (strings)") if name == "inject" else (
                    None, "numbers")
                if isinstance(value, str if item else numbers.Real) and not isinstance(
                        value, bool):
                    value = [value]  # one value, not a list of them
                if not isinstance(value, (list, tuple)) or not all(
                        isinstance(v, item) if item else number(v) for v in value):
                    raise UserError(f"{option(name)} must be a list of {what}, got "
                                    f"{getattr(self, name)!r}")
                value = list(value) if item else [float(v) for v in value]
            else:
                optional = f.type.endswith(" | None")
                kind = f.type.removesuffix(" | None")
                if not (isinstance(value, TYPES[kind][0]) or (optional and value is None)):
                    hint = ""
                    if kind == "str" and isinstance(value, (list, tuple)) and all(
                            isinstance(v, (int, str)) for v in value):  # msit's list form
                        hint = f" (a list is written as text here: {','.join(map(str, value))!r})"
                    raise UserError(f"{option(name)} must be {TYPES[kind][1]}"
                                    f"{' or None' if optional else ''}, got {value!r}{hint}")
            setattr(self, name, value)

    def parsed(self) -> ParsedOptions:
        """The text options parsed (UserError names a bad one): what a session reads."""
        with self.naming():
            return self._parsed()

    def _parsed(self) -> ParsedOptions:
        steps = parse_steps(self.steps)
        probe_steps = parse_steps(self.probe_steps, "probe_steps")
        probes = frozenset(parse_probes(self.probes))
        # a probe-steps list the user gave that names no captured step probes nothing; the
        # default (0,1, or a former one) may miss a capture of later steps only (they are
        # captured clean)
        probing = (probes and self.probe_samples > 0
                   and self.probe_steps not in (PROBE_STEPS, *FORMER_PROBE_STEPS))
        if probing and steps is not None and probe_steps is not None and not any(
                step_selected(steps, k) for lo, hi in probe_steps
                for k in range(lo, int(min(hi, last_step(steps))) + 1)):
            raise UserError(f"{option('probe_steps')} {self.probe_steps} names no captured step "
                            f"({option('steps')} {self.steps}): a probed step must be a "
                            "captured one")
        return ParsedOptions(
            steps=steps, last_step=last_step(steps), probe_steps=probe_steps,
            tokens=parse_tokens(self.tokens), probes=probes, store=parse_store(self.store))

    def faults(self) -> list[FaultSpec]:
        """The ``inject`` specs parsed (the simulator's faults); UserError names a bad one."""
        with self.naming():
            return [parse_fault(text) for text in self.inject]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DumpConfig:
        return cls(**json.loads(text))

    @classmethod
    def from_env(cls) -> DumpConfig | None:
        text = os.environ.get(ENV_CONFIG)
        return cls.from_json(text) if text else None


# msit's DumpConfig keywords (msit llm dump) and what does their job here
MSIT_KEYWORDS = {
    "token_range": 'steps (token_range=[0, 1] is steps="0,1": the prefill and decode step 1)',
    "module_list": 'layers (a glob of block names) or granularity ("sublayer", "op")',
    "api_list": 'granularity="op" (every operator)',
    "tensor_part": "not needed: each module's output is dumped",
    "device": "not needed: capture runs where the model runs",
    "hook_type": "not needed: register_hook always dumps",
    "task": 'store (task="statistics" is store="stats", "tensor" the default store)',
    "level": 'granularity ("block", "sublayer" or "op")',
    "mode": 'granularity ("block", "sublayer" or "op")',
}
# close misspellings and srdd-dump flags with no DumpConfig field of that name
OTHER_KEYWORDS = {
    "sigma": "sigmas (a list: sigmas=[0.1])",
    "no_batch_probes": "batch_probes=False",
    "output": "dump_path",
    "min_free_gb": "srdd-dump's --min-free-gb only (in code no free-space check runs)",
    "eager": "srdd-dump's --eager only (in code, call the model uncompiled)",
    "quiet": "progress=False",
}


def _refusing_unknown_keywords(init):
    """DumpConfig's __init__, naming a keyword it does not take and, for msit's own, the field
    that does its job (a bare TypeError said only "unexpected keyword argument")."""
    def __init__(self, *args, **kwargs):
        names = {f.name for f in fields(DumpConfig)}
        unknown = next((k for k in kwargs if k not in names), None)
        if unknown is not None:
            hint = MSIT_KEYWORDS.get(unknown)
            other = OTHER_KEYWORDS.get(unknown)
            if other is None and hint is None:  # a misspelt field: samples for sample
                close = difflib.get_close_matches(unknown, sorted(names), n=1)
                other = close[0] if close else None
            raise TypeError(f"DumpConfig has no field {unknown!r}"
                            + (f"; msit's {unknown} is {hint}"
                               + ("" if hint.startswith("not needed") else " here") if hint
                               else "")
                            + (f"; use {other}" if other else "")
                            + f" (its fields: {', '.join(sorted(names))})")
        init(self, *args, **kwargs)

    __init__.__doc__, __init__.__wrapped__ = init.__doc__, init
    return __init__


DumpConfig.__init__ = _refusing_unknown_keywords(DumpConfig.__init__)


def parse_steps(spec: str, field: str = "steps") -> list[tuple[int, int]] | None:
    """"0,2-5" -> [(0, 0), (2, 5)] (inclusive); "all" -> None (every step). ``field``: the
    DumpConfig field named in an error."""
    spec = str(spec).strip().lower()
    if not spec:
        raise UserError(f"{option(field)} is empty: use all, or e.g. 0 or 0,1-4")
    if spec in ("all", "*"):
        return None
    ranges = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(v) for v in part.split("-", 1))
            else:
                lo = hi = int(part)
        except ValueError:
            raise UserError(f"bad {option(field)} {spec!r}: use e.g. 0 or 0,1-4 or all") from None
        if lo < 0 or hi < lo:
            raise UserError(f"bad {option(field)} range {part!r}: need 0 <= start <= end")
        ranges.append((lo, hi))
    return ranges


def step_selected(ranges: list[tuple[int, int]] | None, step: int) -> bool:
    return ranges is None or any(lo <= step <= hi for lo, hi in ranges)


def last_step(ranges: list[tuple[int, int]] | None) -> float:
    return float("inf") if ranges is None else max(hi for _, hi in ranges)


def parse_tokens(spec: str) -> list[slice | int] | None:
    """"all" -> None; "0:16" / "-8:" -> slices; "0,5,-1" -> single positions."""
    spec = str(spec).strip().lower()
    if not spec:  # an unset shell variable (--tokens "$T"): not silently every position
        raise UserError(f"{option('tokens')} is empty: use all, or e.g. 0:16, -8: or 0,5,-1")
    if spec in ("all", "*"):
        return None
    parts: list[slice | int] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if ":" in part:
                lo, hi = part.split(":", 1)
                parts.append(slice(int(lo) if lo else None, int(hi) if hi else None))
                start, stop = parts[-1].start, parts[-1].stop
                if stop == 0 or (start is not None and stop is not None
                                 and (start < 0) == (stop < 0) and start >= stop):
                    raise UserError(f"{option('tokens')} {part} keeps no position: its start "
                                    "must come before its end (e.g. 2:5, -8:)")
            else:
                parts.append(int(part))
        except ValueError:
            raise UserError(f"bad {option('tokens')} {spec!r}: use e.g. all, 0:16, -8: or "
                            "0,5,-1") from None
    return parts


def token_positions(parts: list[slice | int] | None, seq: int) -> list[int]:
    """Sorted unique positions in [0, seq) selected by parsed --tokens parts."""
    if parts is None:
        return list(range(seq))
    chosen: set[int] = set()
    for p in parts:
        if isinstance(p, slice):
            chosen.update(range(seq)[p])
        elif -seq <= p < seq:
            chosen.add(p % seq)
    return sorted(chosen)


# DumpConfig's declared field types other than int and list: (type, in words)
TYPES = {"str": (str, "a string"), "bool": (bool, "True or False")}
PROBE_NAMES = ("gain", "dc", "repeat", "scale", "causal", "attention", "mlp", "norm")
GRANULARITIES = ("block", "sublayer", "op")
REFERENCES = ("none", "host")
TP_REPLAYS = ("skip", "lockstep")


def parse_probes(spec: str) -> set[str]:
    """"gain,dc,repeat" -> {"gain", "dc", "repeat"}; "none" -> set()."""
    spec = str(spec).strip().lower()
    if not spec:  # an unset shell variable: not silently no probe at all
        raise UserError(f"{option('probes')} is empty: use none, or e.g. gain,dc,repeat")
    if spec in ("none", "off"):
        return set()
    names = {p.strip() for p in spec.split(",") if p.strip()}
    unknown = names - set(PROBE_NAMES)
    if unknown:
        raise UserError(f"bad {option('probes')} {spec!r}: unknown {sorted(unknown)}; use "
                        f"{PROBE_NAMES}")
    return names


class StoreSpec(NamedTuple):
    """What a dump stores (``--store``)."""

    kind: str  # "full", "sample" or "stats"
    elements: int | None  # probe records keep rows of about this many elements (None: all)
    rows: int = 0  # stats: seeded rows of every block output kept per round (baseline mode)


STATS_ROWS = 2  # --store stats: rows of each block output kept per round
PROBE_ELEMENTS = 32768  # the default sample:N, also the probe rows a stats dump reduces


def parse_store(spec: str) -> StoreSpec:
    """"full"; "sample:N" (probe records keep N elements' worth of rows, N >= 1); "stats" or
    "stats:R" (statistics reduced on the device, R seeded rows of every block output)."""
    text = str(spec).strip().lower()
    if text == "full":
        return StoreSpec("full", None)
    kind, _, number = text.partition(":")
    try:
        n = int(number) if number else None
    except ValueError:
        n = -1
    if kind == "sample" and n is not None and n >= 1:
        return StoreSpec("sample", n)
    if kind == "stats" and (n is None or n >= 0):
        return StoreSpec("stats", PROBE_ELEMENTS, STATS_ROWS if n is None else n)
    raise UserError(f"bad {option('store')} {spec!r}: use full, sample:N (N >= 1) or "
                    "stats[:R] (R >= 0)")
