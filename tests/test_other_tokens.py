"""A generation that drifted to other tokens, in a comparison whose input ids are not recorded
(an msprobe dump of module outputs only): its rounds are set aside, not read as births
(compare/other_tokens.py)."""

from __future__ import annotations

import pandas as pd
import pytest

from srdd_dump.analysis.matching import SAME, UNKNOWN
from srdd_dump.analysis.verdicts import FAIL, NOT_COMPARED, PASS, WARN
from srdd_dump.compare.other_tokens import drifted_rounds, set_aside

pytestmark = pytest.mark.unit


def _rounds(verdicts: dict[int, list[str]], match: str = UNKNOWN, first: int = 0
            ) -> pd.DataFrame:
    """step -> the verdicts of layers first, first + 1, ... of one sample."""
    return pd.DataFrame([
        {"source": "npu", "golden_source": "gpu", "sample": 0, "golden_sample": 0, "step": step,
         "layer": first + k, "input_match": match, "verdict": v, "cosine_similarity": 0.5,
         "cmp_fail_reason": ""}
        for step, row in verdicts.items() for k, v in enumerate(row)])


def test_steps_whose_first_block_fails_after_it_passed_are_set_aside():
    table = _rounds({0: [PASS, FAIL, PASS], 1: [PASS, FAIL, FAIL], 2: [FAIL, FAIL, FAIL],
                     3: [FAIL, FAIL, FAIL]})
    drifted = drifted_rounds(table)
    assert sorted(k[-1] for k in drifted) == [2, 3]
    assert "after it passed in step 0" in drifted[("npu", "gpu", 0, 0, 2)]
    out = set_aside(table, drifted)
    assert (out.loc[out["step"] >= 2, "verdict"] == NOT_COMPARED).all()
    assert out.loc[out["step"] >= 2, "cmp_fail_reason"].str.startswith(
        "inputs likely differ:").all()
    assert out.loc[out["step"] < 2, "verdict"].equals(table.loc[table["step"] < 2, "verdict"])
    assert (out["cosine_similarity"] == 0.5).all()  # the metrics are kept


def test_a_first_block_that_warned_before_counts_as_passed():
    assert list(drifted_rounds(_rounds({0: [WARN, PASS], 1: [FAIL, FAIL]}))) == [
        ("npu", "gpu", 0, 0, 1)]


@pytest.mark.parametrize("table", [
    _rounds({0: [FAIL, FAIL], 1: [FAIL, FAIL]}),  # never passed: the prompt already differs
    _rounds({1: [FAIL, FAIL], 2: [FAIL, FAIL]}),  # no earlier round where it passed
    _rounds({0: [PASS, PASS], 1: [FAIL, FAIL]}, match=SAME),  # ids recorded and equal
    _rounds({0: [PASS, PASS], 1: [FAIL, FAIL]}, first=5),  # a dump of later layers
], ids=["never passed", "no earlier pass", "ids recorded", "not the first block"])
def test_no_round_is_set_aside_without_the_evidence(table):
    assert drifted_rounds(table) == {}
    assert set_aside(table, {}).equals(table)
