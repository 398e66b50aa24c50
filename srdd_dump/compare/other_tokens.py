"""Rounds whose input ids neither dump proves (an msprobe dump of module outputs only) but whose
first block says they differ: a generation that drifted to other tokens.

A decode step's first block sees the step's token and the cache of the tokens before it. Where
the first block passed in an earlier round of the sample (the prompt agreed) and FAILs in this
one, the likely cause is another token fed here: a difference earlier in the generation changed
a greedy choice, and from then on every layer of every later step differs. Such rounds are not
compared (as rounds whose recorded ids differ are not), so that their layers are not read as
births; a fault of the first block in decode steps alone looks the same, and the reason says so.
"""

from __future__ import annotations

import pandas as pd

from ..analysis.matching import UNKNOWN
from ..analysis.verdicts import FAIL, NOT_COMPARED

SAMPLE = ["source", "golden_source", "sample", "golden_sample"]
ROUND = [*SAMPLE, "step"]
REASON = ("inputs likely differ: the input ids of this round are not recorded on both sides, "
          "and the first block FAILs here (cosine {cos}) after it passed in step {step} of the "
          "sample: the generated tokens likely differ from the golden run's from here on, so "
          "the tensors are not judged (a fault of the first block in decode steps alone would "
          "look the same: msprobe's data_mode all records the inputs)")


def drifted_rounds(table: pd.DataFrame) -> dict[tuple, str]:
    """(source, golden_source, sample, golden_sample, step) -> the reason, for each round of
    unknown inputs whose first block (layer 0, or the stack input) FAILs after it passed or
    warned in an earlier round of the same sample."""
    rows = table[table["layer"].notna() & (table["verdict"] != NOT_COMPARED)
                 & (table["input_match"] == UNKNOWN)]
    if rows.empty:
        return {}
    first_layer = rows.groupby(SAMPLE, dropna=False)["layer"].transform("min")
    firsts = rows[(rows["layer"] == first_layer) & (first_layer <= 0)]
    out: dict[tuple, str] = {}
    for _, sample in firsts.sort_values("step").groupby(SAMPLE, dropna=False):
        passed_at = None
        for _, row in sample.iterrows():
            if row["verdict"] != FAIL:
                passed_at = passed_at if passed_at is not None else int(row["step"])
            elif passed_at is not None and int(row["step"]) > passed_at:
                cos = row["cosine_similarity"]
                out[_key(row)] = REASON.format(
                    cos="N/A" if pd.isna(cos) else f"{cos:.6f}", step=passed_at)
    return out


def set_aside(table: pd.DataFrame, drifted: dict[tuple, str]) -> pd.DataFrame:
    """The rows of the drifted rounds as not compared, their metrics kept (they show how far
    the first block is off), the reason in ``cmp_fail_reason``."""
    if not drifted or table.empty:
        return table
    reasons = [drifted.get(_key(row)) for _, row in table[ROUND].iterrows()]
    hit = pd.Series([r is not None for r in reasons], index=table.index)
    if not hit.any():
        return table
    out = table.copy()
    out.loc[hit, "verdict"] = NOT_COMPARED
    out.loc[hit, "cmp_fail_reason"] = [r for r in reasons if r is not None]
    return out


def _key(row: pd.Series) -> tuple:
    return tuple(None if pd.isna(row[c]) else row[c] for c in ROUND)
