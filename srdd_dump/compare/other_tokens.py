"""Rounds whose input ids neither dump proves (an msprobe dump of module outputs only) but whose
first block says they differ: a generation that drifted to other tokens.

A decode step's first block sees the step's token and the cache of the tokens before it. Where
the first block agreed in an earlier round of the sample (the prompt agreed), a difference
then reached the last layer (it can change a greedy choice), and from some step on the first
block FAILs in every captured step to the end, the likely cause is another token fed there,
and every layer of every later step differs. Such rounds are not judged (as rounds whose
recorded ids differ are not), so that their layers are not read as births; the finding says
so. A fault of the first block in decode steps alone, after a prompt that differed at its
last layer, looks the same, and the reason says so; one whose first block passes again later,
or after a prompt that agreed to its last layer, is judged as before.
"""

from __future__ import annotations

import pandas as pd

from ..analysis.matching import UNKNOWN
from ..analysis.verdicts import FAIL, NOT_COMPARED, PASS, WARN

SAMPLE = ["source", "golden_source", "sample", "golden_sample"]
ROUND = [*SAMPLE, "step"]
HEAD = "inputs likely differ"
REASON = (HEAD + ": the input ids of this round are not recorded on both sides, and the first "
          "block FAILs here (cosine {cos}) and in every later step, after it agreed in step "
          "{agreed} while the last layer differed in step {reached} ({verdict} at layer "
          "{layer}): the generated tokens likely differ from the golden run's, so the tensors "
          "are not judged (a fault of the first block in decode steps alone would look the "
          "same: msprobe's data_mode all records the inputs)")


def drifted_rounds(table: pd.DataFrame) -> dict[tuple, str]:
    """(source, golden_source, sample, golden_sample, step) -> the reason, for the rounds of
    unknown inputs from the first step whose first block (layer 0, or the stack input) FAILs
    to the sample's end, where the first block FAILs or WARNs in every one of them, agreed
    (PASS or WARN) in an earlier round, and an earlier round's last layer was beyond
    tolerance."""
    rows = table[table["layer"].notna() & (table["verdict"] != NOT_COMPARED)
                 & (table["input_match"] == UNKNOWN)]
    if rows.empty:
        return {}
    out: dict[tuple, str] = {}
    for _, sample in rows.groupby(SAMPLE, dropna=False):
        # a dump of later layers (its stack input, -1, then an earlier block's output): the
        # first block it holds is not the model's, which sees only the token
        if not (sample["layer"] == 0).any():
            continue
        first_layer = sample["layer"].min()
        by_step = sorted(sample.groupby("step"), key=lambda kv: kv[0])
        firsts = [group[group["layer"] == first_layer] for _, group in by_step]
        lasts = [group.loc[group["layer"].idxmax()] for _, group in by_step]
        agreed = reached = None
        for k, ((step, _), first) in enumerate(zip(by_step, firsts)):
            if first.empty:
                continue
            verdict = first["verdict"].iloc[0]
            if verdict == FAIL and agreed is not None and reached is not None and all(
                    not f.empty and f["verdict"].iloc[0] in (WARN, FAIL) for f in firsts[k:]):
                row = first.iloc[0]
                cos = row["cosine_similarity"]
                last = lasts[reached]
                reason = REASON.format(
                    cos="N/A" if pd.isna(cos) else f"{cos:.6f}", agreed=agreed,
                    reached=int(by_step[reached][0]), verdict=last["verdict"],
                    layer=int(last["layer"]))
                for later, _ in by_step[k:]:
                    out[(*_sample_key(row), int(later))] = reason
                break
            if verdict in (PASS, WARN) and agreed is None:
                agreed = int(step)
            if agreed is not None and lasts[k]["verdict"] in (WARN, FAIL):
                reached = k
    return out


def set_aside(table: pd.DataFrame, drifted: dict[tuple, str]) -> pd.DataFrame:
    """The compared rows of the drifted rounds as not compared, their metrics kept (they show
    how far the first block is off), the reason before any they had in ``cmp_fail_reason``;
    rows not compared already keep their own reason."""
    if not drifted or table.empty:
        return table
    reasons = [drifted.get(_key(row)) for _, row in table[ROUND].iterrows()]
    hit = pd.Series([r is not None for r in reasons], index=table.index) & (
        table["verdict"] != NOT_COMPARED)
    if not hit.any():
        return table
    out = table.copy()
    had = out.loc[hit, "cmp_fail_reason"].fillna("").astype(str)
    said = pd.Series([r for r, h in zip(reasons, hit) if h], index=had.index)
    out.loc[hit, "verdict"] = NOT_COMPARED
    out.loc[hit, "cmp_fail_reason"] = said.where(had == "", said + "; " + had)
    return out


def set_aside_rounds(table: pd.DataFrame) -> dict[tuple, str]:
    """The rounds of a table ``set_aside`` marked, with their reason (for the sub-layers of
    the same rounds)."""
    reasons = table["cmp_fail_reason"].fillna("").astype(str)
    aside = table[reasons.str.startswith(HEAD)]
    return {_key(row): reason.split("; ")[0]
            for (_, row), reason in zip(aside[ROUND].iterrows(), reasons[aside.index])}


def said(table: pd.DataFrame) -> str:
    """The finding's clause for the rounds set aside: '' when none was."""
    aside = set_aside_rounds(table)
    if not aside:
        return ""
    rounds = pd.DataFrame(list(aside), columns=ROUND)
    steps = sorted({int(s) for s in rounds["step"]})
    return (f"; {len(rounds)} decode round{'s' if len(rounds) != 1 else ''} (step"
            f"{'s' if len(steps) != 1 else ''} {', '.join(map(str, steps))}) not judged: the "
            "first block FAILs there to the sample's end after a difference reached the last "
            "layer, so the generated tokens likely differ (no input ids recorded; a fault of "
            "the first block in decode steps alone would look the same)")


def _sample_key(row: pd.Series) -> tuple:
    return tuple(None if pd.isna(row[c]) else row[c] for c in SAMPLE)


def _key(row: pd.Series) -> tuple:
    return tuple(None if pd.isna(row[c]) else row[c] for c in ROUND)
