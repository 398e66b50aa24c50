"""One-screen summaries of compare results for the terminal."""

from __future__ import annotations

import math
from collections import Counter

from ..analysis.verdicts import FAIL, NORMAL, NOT_COMPARED, PASS, VERDICT_ORDER, VERDICTS, WARN
from ..compare.results import (
    INCOMPLETE,
    OK,
    SKIPPED,
    BaselineResult,
    CompareResult,
    ConsistencyResult,
)
from ..compare.table import missing

TOP = 10
SHOWN = ["verdict", "diagnosis", "score", "source", "layer", "module", "gain", "instability"]
MAX_TEXT = 40
UNMATCHED_SHOWN = 5


def diagnosis_text(result: CompareResult, written: list[str] | None = None,
                   explain: bool = False) -> str:
    """The first screen: one verdict sentence per file (healthy: "no faulty layer found in N
    layers x M samples"), files read/skipped/incomplete, layers per verdict, the FAULT and
    SUSPECT rows (no table when there are none), the evidence behind each (``explain``) and the
    report path."""
    layers, files = result.layer_table, result.file_table
    lines, said = [], set()
    for i, headline in enumerate(result.headlines):  # a FAULT's hunt under its own headline
        lines.append(headline)
        hunt = result.hunt_of.get(i)
        if hunt in result.hunts:
            lines.append(hunt_line(hunt))
            said.add(hunt)
    lines += [hunt_line(hunt) for hunt in result.hunts if hunt not in said]
    if result.missing_evidence:
        lines.append("evidence missing from these verdicts (the capture asked for it and did "
                     "not get it):")
        lines.extend(f"  {line}" for line in result.missing_evidence)
    status = Counter(files.column("status"))
    n_ok, n_inc, n_skip = (status[k] for k in (OK, INCOMPLETE, SKIPPED))
    lines.append(
        f"files: {len(files)} found, {n_ok + n_inc} read ({n_inc} incomplete), {n_skip} skipped"
    )
    verdicts = Counter(layers.column("verdict"))
    by_verdict = ", ".join(f"{verdicts[v]} {v}" for v in VERDICT_ORDER)
    lines.append(f"layers: {len(layers)} rows: {by_verdict}")
    flagged = [r for r in layers.rows if r["verdict"] != NORMAL]
    if flagged:
        more = f" (of {len(flagged)}; all in the report)" if len(flagged) > TOP else ""
        lines.append(f"flagged layers{more}:")
        lines.extend("  " + line for line in aligned(flagged[:TOP], SHOWN))
    if explain:
        if flagged:
            lines.append("evidence:")
        for r in flagged:
            lines.append(f"  {r['source']} layer {r['layer']} {r['verdict']}: {r['evidence']}")
    if result.consistency is not None:
        lines.append(consistency_text(result.consistency))
    if written:
        lines.append("report: " + ", ".join(written))
    return "\n".join(lines)


def hunt_line(hunt: str) -> str:
    """The sentence that hands the user the command capturing a FAULT layer's operators."""
    return f"to name the operator inside it, capture that layer's operators: {hunt}"


def aligned(rows: list[dict], columns: list[str]) -> list[str]:
    """``columns`` of ``rows`` as a text table: a header line, then one line per row, each
    column right-aligned to its widest cell; numbers to 4 significant digits, long texts
    shortened from the left (a path's end says most), the labels from the right (the first
    is the main one); "-" where the report's cell is empty (not measured: "NaN" would read as
    an overflow)."""
    cells = [[_cell(r.get(c), keep_start=c == "diagnosis") for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    return [" ".join(text.rjust(w) for text, w in zip(line, widths))
            for line in [columns, *cells]]


def _cell(value, keep_start: bool = False) -> str:
    if missing(value):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    if keep_start and len(text) > MAX_TEXT:
        return text[:MAX_TEXT - 3] + "..."
    return _shorten(text)


def _shorten(text) -> str:
    text = str(text)
    return text if len(text) <= MAX_TEXT else "..." + text[-(MAX_TEXT - 3) :]


def consistency_text(result: ConsistencyResult) -> str:
    """Terminal lines: the groups compared and, per group, the odd card out (or none)."""
    lines = [
        f"consistency: {len(result.groups)} group(s) of sources with the same model and inputs "
        f"({', '.join(str(len(g)) for g in result.groups)} sources)"
    ]
    lines += [f"  {m}" for m in result.messages]
    if result.skipped_rounds:
        lines.append(f"  {result.skipped_rounds} (round, layer) pairs left out: a source lacked "
                     f"the record or its shape differed")
    return "\n".join(lines)


WORST_SHOWN = [
    "layer", "module", "verdict", "min_cosine_similarity", "max_relative_euclidean_distance",
    "max_error_amplification",
]


def baseline_text(result: BaselineResult, written: list[str] | None = None) -> str:
    """One screen: files, verdict counts, the finding, the first divergence, the worst layers."""
    s = result.summary
    files = result.files
    lines = []
    for role, label in (("my", "my dumps"), ("golden", "golden dumps")):
        side = files[files["role"] == role]
        skipped = int((side["status"] == SKIPPED).sum())
        incomplete = int((side["status"] == INCOMPLETE).sum())
        where = result.path if role == "my" else result.baseline
        n = len(side)
        lines.append(f"{label}: {where}: {n} file{'s' if n != 1 else ''}, {skipped} skipped"
                     + (f", {incomplete} incomplete (a process stopped before finishing it)"
                        if incomplete else ""))
    counts = ", ".join(f"{s.verdicts[v]} {v}" for v in VERDICTS)
    lines.append(f"rows: {len(result.table)} ({s.rounds} compared "
                 f"round{'s' if s.rounds != 1 else ''}): {counts}")
    for reason, n in s.not_compared.items():
        lines.append(f"not compared: {n} row{'s' if n != 1 else ''}: {reason}")
    lines.append(f"finding: {s.message}")
    if s.first_layer is not None:
        inside = f", inside it {s.first_site}" if s.first_site else ""
        where = (f"layer {s.first_layer} ({s.first_module})" if s.first_layer >= 0
                 else f"the stack input (the input of {s.first_module or 'the first block'})")
        lines.append(f"first divergence: {where}{inside}")
    if len(result.sites):
        compared = int((result.sites["verdict"] != NOT_COMPARED).sum())
        pairs = result.sites.loc[result.sites["verdict"] != NOT_COMPARED, "matched_by"]
        how = ", ".join(f"{n} by {k}" for k, n in pairs.value_counts().items())
        verdicts = result.sites["verdict"].value_counts()
        how += "): " + ", ".join(f"{int(verdicts.get(v, 0))} {v}" for v in (PASS, WARN, FAIL))
        lines.append(f"sub-layers and operators: {compared} rows compared ({how}" if compared
                     else f"sub-layers and operators: none compared ({_why_none(result.sites)})")
    for line in s.unmatched[:UNMATCHED_SHOWN]:
        lines.append(f"unmatched: {line}")
    if len(s.unmatched) > UNMATCHED_SHOWN:
        lines.append(f"unmatched: {len(s.unmatched) - UNMATCHED_SHOWN} more (see the "
                     "sublayers table)")
    if len(s.worst):
        lines.append("worst layers:")
        top = s.worst[WORST_SHOWN].rename(columns={
            "min_cosine_similarity": "cosine(min)",
            "max_relative_euclidean_distance": "rel_dist(max)",
            "max_error_amplification": "growth(max)",
        })
        top["module"] = top["module"].map(_shorten)
        # an empty cell (a statistics row has no cosine) reads N/A, as in the CSV: "NaN"
        # would read as an overflow
        text = top.to_string(index=False, na_rep="N/A", formatters={
            "cosine(min)": cosine_text, "rel_dist(max)": "{:.3g}".format,
            "growth(max)": "{:.3g}".format,
        })
        lines.extend("  " + line for line in text.splitlines())
        shown = {int(k) for k in top["layer"] if k == k}  # NaN: a row of no layer
        if (s.first_layer is not None and s.first_layer >= 0 and s.first_layer not in shown
                and shown and max(shown) > s.first_layer):
            lines.append(f"  (the largest errors; the error is born at layer {s.first_layer}, "
                         "the finding's, and grows in the layers after it)")
        if s.bounded:
            lines.append("  rel_dist(max): where a side has statistics only, the smallest "
                         "relative error they prove (red_lower_bound), not the error itself")
    if written:
        lines.append("report: " + ", ".join(written))
    return "\n".join(lines)


def cosine_text(cosine: float) -> str:
    """A cosine similarity at 6 decimals, with more where those would round a value below 1
    up to 1.000000 (a WARN row would read as a perfect match)."""
    text = f"{cosine:.6f}"
    if text != "1.000000" or not cosine < 1:
        return text
    # two significant digits of the gap to 1 (0.9999999999954, not 0.9999999999953928)
    decimals = 1 - math.floor(math.log10(1.0 - float(cosine)))
    return f"{cosine:.{decimals}f}".rstrip("0")


def _why_none(sites) -> str:
    """Why no sub-layer row was compared: no counterpart (the unmatched lines name them), or
    the commonest reason of the rows' own (their rounds' inputs differ, ...)."""
    reasons = sites["cmp_fail_reason"].fillna("").astype(str)
    absent = int(reasons.str.startswith("no counterpart").sum())
    if absent == len(sites):
        return f"{absent} rows have no counterpart: see the unmatched lines"
    top = reasons[~reasons.str.startswith("no counterpart")].str.split(": ").str[0]
    reason, n = top.value_counts().index[0], int(top.value_counts().iloc[0])
    return f"{n} of {len(sites)} rows: {reason}" + (
        f"; {absent} have no counterpart: see the unmatched lines" if absent else "")
