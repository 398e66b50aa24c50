"""One-screen summary of a comparison for the terminal."""

from __future__ import annotations

from ..analysis.diagnosis import VERDICT_ORDER
from .table import INCOMPLETE, OK, SKIPPED

TOP = 10
SHOWN = ["verdict", "diagnosis", "score", "source", "layer", "module", "gain", "instability"]
MAX_TEXT = 40


def summary(result, explain: bool = False) -> str:
    """Verdict sentences, files read/skipped/incomplete, layers per verdict, the top rows, the
    evidence behind every FAULT/SUSPECT row (``explain``) and the report path."""
    layers, files, written = result.layers, result.files, result.written
    lines = list(result.headlines)
    status = files["status"].value_counts()
    n_ok, n_inc, n_skip = (int(status.get(k, 0)) for k in (OK, INCOMPLETE, SKIPPED))
    lines.append(
        f"files: {len(files)} found, {n_ok + n_inc} read ({n_inc} incomplete), {n_skip} skipped"
    )
    verdicts = layers["verdict"].value_counts()
    by_verdict = ", ".join(f"{int(verdicts.get(v, 0))} {v}" for v in VERDICT_ORDER)
    lines.append(f"layers: {len(layers)} rows: {by_verdict}")
    if len(layers):
        top = layers[SHOWN].head(TOP).copy()
        for col in ("source", "module"):
            top[col] = top[col].map(_shorten)
        lines.append(f"most suspicious {len(top)}:")
        text = top.to_string(index=False, float_format=lambda x: f"{x:.4g}")
        lines.extend("  " + line for line in text.splitlines())
    if explain:
        flagged = layers[layers["verdict"] != "NORMAL"]
        if len(flagged):
            lines.append("evidence:")
        for _, r in flagged.iterrows():
            lines.append(f"  {r['source']} layer {r['layer']} {r['verdict']}: {r['evidence']}")
    if getattr(result, "consistency", None) is not None:
        from .consistency_report import consistency_text

        lines.append(consistency_text(result.consistency))
    if written:
        lines.append("report: " + ", ".join(written))
    return "\n".join(lines)


def _shorten(text) -> str:
    text = str(text)
    return text if len(text) <= MAX_TEXT else "..." + text[-(MAX_TEXT - 3) :]
