"""A generation that drifted to other tokens, in a comparison whose input ids are not recorded
(an msprobe dump of module outputs only): its rounds are set aside, not read as births
(compare/other_tokens.py)."""

from __future__ import annotations

import pandas as pd
import pytest

from srdd_dump.analysis.matching import SAME, UNKNOWN
from srdd_dump.analysis.verdicts import FAIL, NOT_COMPARED, PASS, WARN
from srdd_dump.compare.other_tokens import drifted_rounds, said, set_aside

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
    table.loc[(table["step"] == 3) & (table["layer"] == 2), ["verdict", "cmp_fail_reason"]] = \
        [NOT_COMPARED, "missing record: no my data for this layer in this round"]
    drifted = drifted_rounds(table)
    assert sorted(k[-1] for k in drifted) == [2, 3]
    assert "after it agreed in step 0 while the last layer differed in step 1 (FAIL at " \
        "layer 2)" in drifted[("npu", "gpu", 0, 0, 2)]
    out = set_aside(table, drifted)
    judged = table["verdict"] != NOT_COMPARED
    assert (out.loc[out["step"] >= 2, "verdict"] == NOT_COMPARED).all()
    assert out.loc[(out["step"] >= 2) & judged, "cmp_fail_reason"].str.startswith(
        "inputs likely differ:").all()
    # a row not compared already keeps its own reason
    assert out.loc[~judged, "cmp_fail_reason"].tolist() == [
        "missing record: no my data for this layer in this round"]
    assert out.loc[out["step"] < 2, "verdict"].equals(table.loc[table["step"] < 2, "verdict"])
    assert (out["cosine_similarity"] == 0.5).all()  # the metrics are kept
    assert said(out).startswith("; 2 decode rounds (steps 2, 3) not judged: ")


def test_a_first_block_that_warned_before_counts_as_agreed():
    assert list(drifted_rounds(_rounds({0: [WARN, WARN], 1: [FAIL, FAIL]}))) == [
        ("npu", "gpu", 0, 0, 1)]


def test_a_first_block_that_passes_again_is_judged_where_it_failed():
    """An intermittent fault of the first block: the step where it passes again shows the
    tokens were the same, so the FAIL before it is judged; a FAIL that lasts to the end after
    it is set aside."""
    table = _rounds({0: [PASS, FAIL], 1: [FAIL, PASS], 2: [PASS, PASS], 7: [FAIL, FAIL]})
    assert [k[-1] for k in drifted_rounds(table)] == [7]


def test_a_decode_only_fault_of_the_first_block_is_judged_where_it_starts():
    """A prompt that agreed to its last layer cannot have changed the next token: the first
    decode step whose first block FAILs is judged (a decode-only kernel); the steps after it,
    whose tokens it may have changed, are set aside (a reviewer found every decode round of
    such a fault set aside, the finding a clean PASS)."""
    table = _rounds({0: [PASS, PASS, PASS], 1: [FAIL, FAIL, FAIL], 2: [FAIL, FAIL, FAIL]})
    assert [k[-1] for k in drifted_rounds(table)] == [2]


@pytest.mark.parametrize("table", [
    _rounds({0: [FAIL, FAIL], 1: [FAIL, FAIL]}),  # never passed: the prompt already differs
    _rounds({1: [FAIL, FAIL], 2: [FAIL, FAIL]}),  # no earlier round where it passed
    _rounds({0: [PASS, PASS], 1: [FAIL, FAIL]}, match=SAME),  # ids recorded and equal
    _rounds({0: [PASS, FAIL], 1: [FAIL, FAIL]}, first=5),  # a dump of later layers
    _rounds({0: [PASS, PASS, FAIL], 1: [FAIL, FAIL, FAIL]}, first=-1).assign(  # and its
        layer=lambda t: t["layer"].replace({0: 5, 1: 6})),  # stack input (layer 4's output)
    _rounds({0: [PASS, PASS], 1: [FAIL, FAIL]}),  # the prompt agreed to its last layer
], ids=["never passed", "no earlier pass", "ids recorded", "not the first block",
        "a later block's stack input", "prompt agreed to the end"])
def test_no_round_is_set_aside_without_the_evidence(table):
    assert drifted_rounds(table) == {}
    assert set_aside(table, {}).equals(table) and said(table) == ""
