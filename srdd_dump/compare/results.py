"""What a compare returns: one result type per mode, with the columns of each of its tables.

The report package renders these; nothing here writes a file. Table cells are numbers, text
and booleans; verdict words come from ``analysis.verdicts``. The reference-free result holds
its tables as rows (``table.Table``) and gives them as DataFrames on first use: its CSV report
and terminal summary need no pandas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..analysis.verdicts import (
    AS_DIAGNOSIS,
    FAIL_ON,
    FAULT,
    NORMAL,
    NOT_COMPARED,
    SUSPECT,
    VERDICT_ORDER,
)
from .sources import INCOMPLETE, OK, SKIPPED
from .table import Table

if TYPE_CHECKING:
    import pandas as pd

# a baseline row's reason when msprobe's md5 values (summary_mode md5) of the two sides differ:
# the tensors differ, whatever their statistics prove (divergence.py reads it)
MD5_DIFFER = "the md5 of the two sides differ (the tensors differ)"

# file statuses, defined with the files; --fail-on's levels, with the verdicts
__all__ = ["FAIL_ON", "INCOMPLETE", "OK", "SKIPPED"]

# -- reference-free ----------------------------------------------------------------------------

# Layer and sub-layer tables: the Signals fields of docs/method.md, by their names.
BASE_COLUMNS = [
    "source", "layer", "module", "score", "verdict", "diagnosis", "mean", "std", "absmax",
    "kurtosis", "zero_frac", "nan_count", "inf_count", "samples",
]
SIGNAL_COLUMNS = [
    "kurt_change", "gain", "gain_spread", "linearity", "dc_dead", "dc_low", "instability",
    "instab_changed", "batch_dep", "ties", "tie_excess", "pileup", "offset", "dc_energy", "stuck",
    "lowbits", "grid", "update_rms", "scale_broken", "scale_pattern", "causal_broken", "host_red",
    "host_channel_red",
    "dtype",
]
# site: the module holding the strongest evidence; evidence: every finding with its strength
# expert: the expert of a mixture-of-experts layer the site is (blank for other sites)
LAYER_COLUMNS = BASE_COLUMNS + SIGNAL_COLUMNS + ["site", "expert", "evidence", "rank", "pid"]
# tokens, topk_margin: an expert's routed tokens and their median router margin
SITE_COLUMNS = (["source", "layer", "module", "expert", "role", "phase", "score", "verdict",
                 "diagnosis"] + BASE_COLUMNS[6:] + SIGNAL_COLUMNS
                + ["tokens", "topk_margin", "rank", "pid"])
FILE_COLUMNS = ["source", "status", "reason", "rounds", "samples", "layers", "rank", "pid"]


class TableAsFrame:
    """An attribute read as a DataFrame (``Table.frame``) and set from a DataFrame or a
    ``Table``, held as a Table in ``table_attr``."""

    def __init__(self, table_attr: str):
        self.table_attr = table_attr

    def __get__(self, obj: object, owner: type | None = None) -> pd.DataFrame | TableAsFrame:
        return self if obj is None else getattr(obj, self.table_attr).frame()

    def __set__(self, obj: object, value: Table | pd.DataFrame) -> None:
        setattr(obj, self.table_attr, Table.of(value))


class CompareResult:
    """Reference-free diagnosis of every dump file under ``path``. Its tables are DataFrames
    (``layers``, ``files``, ``sites``: built on first use) over rows (``layer_table``...: what
    the CSV report and the terminal read); each may be given or set as either."""

    layers = TableAsFrame("layer_table")
    files = TableAsFrame("file_table")
    sites = TableAsFrame("site_table")

    def __init__(
        self, path: str, layers: Table | pd.DataFrame, files: Table | pd.DataFrame,
        sites: Table | pd.DataFrame | None = None, headlines: list[str] | None = None,
        hunts: list[str] | None = None, consistency: ConsistencyResult | None = None,
        notes: list[str] | None = None, missing_evidence: list[str] | None = None,
        hunt_of: dict[int, str] | None = None,
    ):
        self.path = path  # what was compared, as given
        # LAYER_COLUMNS: one row per (file, block layer), most suspicious first
        self.layers = layers
        self.files = files  # FILE_COLUMNS: one row per dump file found
        # SITE_COLUMNS: one row per (file, sub-layer module) when the dump has sub-layers
        self.sites = Table(SITE_COLUMNS, []) if sites is None else sites
        self.headlines = headlines or []  # one verdict sentence per file
        # srdd-dump commands that capture the operators of a FAULT layer (compare/hunt.py)
        self.hunts = hunts or []
        # headline index -> the hunt of its FAULT (the terminal prints it under that headline)
        self.hunt_of = hunt_of or {}
        self.consistency = consistency  # when 3+ cards ran the same inputs
        self.notes = notes or []  # e.g. which run of a folder was compared
        # evidence the capture asked for and did not get: the verdicts cannot rest on it
        self.missing_evidence = missing_evidence or []

    @property
    def skipped_reasons(self) -> list[str]:
        return [r["reason"] for r in self.file_table.rows if r["status"] == SKIPPED]

    def worst_verdict(self) -> str:
        """FAULT, SUSPECT or NORMAL: the worst layer verdict of every file; an odd card out
        of the consistency check (one card of a group departs from the others) is a FAULT."""
        verdicts = set(self.layer_table.column("verdict"))
        if self.consistency is not None and self.consistency.odd_sources:
            verdicts.add(FAULT)
        return next((v for v in (FAULT, SUSPECT) if v in verdicts), NORMAL)


# -- GPU baseline ------------------------------------------------------------------------------

ID_COLUMNS = [
    "source", "golden_source", "sample", "golden_sample", "step", "layer", "module",
    "golden_layer", "golden_module", "input_match",
]
# msit llm compare's columns, in its order (its data path and op type columns do not apply).
MSIT_COLUMNS = [
    "golden_dtype", "golden_shape", "golden_max_value", "golden_min_value", "golden_mean_value",
    "my_dtype", "my_shape", "my_max_value", "my_min_value", "my_mean_value",
    "cosine_similarity", "max_relative_error", "mean_relative_error", "max_absolute_error",
    "mean_absolute_error", "kl_divergence", "relative_euclidean_distance", "cmp_fail_reason",
]
EXTRA_COLUMNS = [
    "sqnr", "euclidean_distance", "one_thousandth_err_ratio", "five_thousandths_err_ratio",
    "golden_nan_inf", "my_nan_inf", "error_amplification", "tolerance", "verdict", "highlight",
    "first_divergence", "first_fail",
    # a statistics-only side (msprobe task statistics): the L2 norms, and the relative error
    # the two sides' max/min/mean/norm prove (analysis.summary_stats); N/A otherwise
    "golden_norm", "my_norm", "red_lower_bound",
]
BASELINE_COLUMNS = ID_COLUMNS + MSIT_COLUMNS + EXTRA_COLUMNS
# from the whole run
DERIVED_COLUMNS = ["error_amplification", "highlight", "first_divergence", "first_fail"]
# sub-layers and operators of the paired blocks: module / golden_module name the sites (a fused
# site's parts joined by " + "), matched_by how they were paired (analysis.site_names);
# error_amplification is over the block's input (the previous block's output), first_divergence
# marks the site where the error of a birth layer is born
SITE_BASELINE_COLUMNS = (ID_COLUMNS + ["matched_by"] + MSIT_COLUMNS + EXTRA_COLUMNS[:6]
                         + ["error_amplification", "tolerance", "verdict", "first_divergence"]
                         + EXTRA_COLUMNS[-3:])
SITE_DERIVED_COLUMNS = ["error_amplification", "first_divergence"]
BASELINE_FILE_COLUMNS = [
    "role", "source", "status", "reason", "paired_with", "rounds", "samples", "layers", "rank",
    "pid",
]
PER_LAYER_COLUMNS = [
    "layer", "module", "rows", "verdict", "min_cosine_similarity",
    "max_relative_euclidean_distance", "max_error_amplification", "first_divergences",
]


@dataclass
class BaselineSummary:
    """What the terminal and the XLSX summary sheet say about a baseline comparison."""

    verdicts: dict[str, int]  # rows per verdict (PASS, WARN, FAIL, N/A)
    rounds: int  # compared rounds (source, sample, step)
    first_divergence: pd.DataFrame  # the rows with first_divergence (the birth of the error)
    first_layer: int | None  # earliest layer where the error was born (-1 = stack input)
    first_module: str
    first_rounds: int  # rounds in which it was born at first_layer
    per_layer: pd.DataFrame  # PER_LAYER_COLUMNS, one row per layer over every round: the chart
    worst: pd.DataFrame  # the layers with the largest relative error, PER_LAYER_COLUMNS
    not_compared: dict[str, int] = field(default_factory=dict)  # reason -> rows
    first_exact_input: bool = False  # the birth layer's input equals the golden run's
    pattern: str = ""  # introduced | born | site | gradual | clean | nothing
    message: str = ""  # the finding, one sentence
    first_site: str = ""  # inside first_layer: the sub-layer or operator where it was born
    first_site_rounds: int = 0  # of the first_rounds, those in which first_site was
    site_verdicts: tuple[str, ...] = ("FAIL",)  # first_site's rows marked as the birth
    unmatched: list[str] = field(default_factory=list)  # sites paired with nothing, one line
    # per name (relative to its block) and side
    bounded: bool = False  # a side had statistics only: per_layer's RED is the bound they prove


@dataclass
class BaselineResult:
    """My dumps compared layer by layer with golden dumps (msit's metrics and more)."""

    path: str  # my dumps, as given
    baseline: str  # golden dumps, as given
    table: pd.DataFrame  # BASELINE_COLUMNS, in (source, sample, step, layer) order
    files: pd.DataFrame  # BASELINE_FILE_COLUMNS, one row per dump file of either side
    summary: BaselineSummary
    thresholds: object  # analysis.tolerance.Thresholds used
    notes: list[str] = field(default_factory=list)  # e.g. which run of a folder was compared
    # SITE_BASELINE_COLUMNS: sub-layers and operators of the paired blocks (empty when the
    # dumps hold none on both sides)
    sites: pd.DataFrame = field(default_factory=lambda: _empty(SITE_BASELINE_COLUMNS))

    @property
    def skipped_reasons(self) -> list[str]:
        return list(self.files.loc[self.files["status"] == SKIPPED, "reason"])

    @property
    def nothing_compared(self) -> str | None:
        """Why not one row of the two dumps could be compared (each reason with its rows), or
        None when some were."""
        if self.summary.pattern != "nothing" or (
                len(self.sites) and (self.sites["verdict"] != NOT_COMPARED).any()):
            return None  # block rows, or sub-layer and operator rows (an msprobe mix dump)
        why = "; ".join(f"{n} rows: {reason}" for reason, n in self.summary.not_compared.items())
        return why or "no round of one dump pairs with a round of the other"

    def worst_verdict(self) -> str:
        """In the reference-free vocabulary, for ``--fail-on``: FAIL -> FAULT, WARN -> SUSPECT;
        a sub-layer FAIL named as the finding (pattern "site") is a FAULT too."""
        verdicts = {AS_DIAGNOSIS[v] for v in set(self.table["verdict"])}
        if self.summary.pattern == "site":
            verdicts.add(FAULT)
        return min(verdicts | {NORMAL}, key=VERDICT_ORDER.__getitem__)


# -- multi-card consistency --------------------------------------------------------------------

CONSISTENCY_COLUMNS = [
    "group", "source", "layer", "module", "rounds", "cosine_similarity", "max_absolute_error",
    "relative_error", "others_relative_error", "nan_inf", "tolerance", "departs",
    "first_departure",
]
CONSISTENCY_SUMMARY_COLUMNS = [
    "group", "source", "sources", "rounds", "odd", "first_departing_layer",
    "first_departing_module", "worst_layer", "max_relative_error",
]


@dataclass
class ConsistencyResult:
    """Each card against the median of the others, for groups of 3+ cards on the same inputs."""

    table: pd.DataFrame  # CONSISTENCY_COLUMNS: one row per (group, layer, source), layer order
    summary: pd.DataFrame  # CONSISTENCY_SUMMARY_COLUMNS: one row per (group, source)
    groups: list[list[str]]  # the sources of each group
    messages: list[str]  # one line per group naming the odd card out (or none)
    skipped_rounds: int = 0  # (round, layer) pairs left out: a source lacked the record or shape

    @property
    def odd_sources(self) -> list[str]:
        return list(self.summary.loc[self.summary["odd"], "source"])


def _empty(columns: list[str]) -> pd.DataFrame:
    import pandas as pd

    return pd.DataFrame(columns=columns)
