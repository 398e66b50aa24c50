"""Report contents stay the same: the committed golden dumps give the committed golden reports,
cell by cell, in all three compare modes (reference-free, baseline, consistency), with one
process and with two. tests/golden/make_golden.py made both."""

from __future__ import annotations

import math
import os

import pandas as pd
import pytest

from capture_utils import run_cli

pytestmark = pytest.mark.integration

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "golden")
CARDS = os.path.join(GOLDEN, "dumps", "cards")
REPORTS = os.path.join(GOLDEN, "reports")
RTOL = 1e-9  # summation order may change in the last bits; anything more is a change
# ... and a metric that is a difference of near-equal sums, in absolute terms: the KL divergence
# sums p*log(p/q) over probabilities that add up to 1, so the last bit of np.log (whose SIMD code
# differs by CPU: AVX2, AVX-512) moves it by ~1e-16 whatever its size (seen: 6.7e-10 off by
# 2.2e-16, a relative 3e-7). 1e-14 is about 50 units in the last place of 1.
ATOL = {"kl_divergence": 1e-14}


def _same_cell(want, got, col: str = "") -> bool:
    if isinstance(want, float) and isinstance(got, float):
        if math.isnan(want) or math.isnan(got):
            return math.isnan(want) and math.isnan(got)
        return want == got or abs(want - got) <= max(RTOL * max(abs(want), abs(got)),
                                                     ATOL.get(col, 0.0))
    return want == got


def _assert_same_csv(want_path: str, got_path: str) -> None:
    want = pd.read_csv(want_path, keep_default_na=False, na_values=[""])
    got = pd.read_csv(got_path, keep_default_na=False, na_values=[""])
    name = os.path.basename(want_path)
    assert list(got.columns) == list(want.columns), name
    assert len(got) == len(want), name
    for col in want.columns:
        for i, (w, g) in enumerate(zip(want[col].tolist(), got[col].tolist())):
            assert _same_cell(w, g, col), f"{name} row {i} column {col}: want {w!r}, got {g!r}"


def _golden(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(REPORTS) if n.startswith(prefix + "."))


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_reference_free_and_consistency_reports_unchanged(tmp_path, jobs):
    out = tmp_path / "free.csv"
    done = run_cli("srdd-compare", CARDS, "-o", str(out), "-q", "-j", jobs)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path)) == _golden("free")
    for name in _golden("free"):
        _assert_same_csv(os.path.join(REPORTS, name), str(tmp_path / name))


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_baseline_report_unchanged(tmp_path, jobs):
    out = tmp_path / "baseline.csv"
    done = run_cli("srdd-compare", os.path.join(CARDS, "card2.h5"), "--baseline",
                   os.path.join(CARDS, "card0.h5"), "-o", str(out), "-q", "-j", jobs)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path)) == _golden("baseline")
    for name in _golden("baseline"):
        _assert_same_csv(os.path.join(REPORTS, name), str(tmp_path / name))


def test_golden_dump_has_a_fault_to_find():
    """The fixture is not vacuous: the planted layer is the top FAULT row, and the consistency
    check names the faulty card."""
    layers = pd.read_csv(os.path.join(REPORTS, "free.csv"))
    top = layers.iloc[0]
    assert (top["source"], int(top["layer"]), top["verdict"]) == ("card2.h5", 2, "FAULT")
    summary = pd.read_csv(os.path.join(REPORTS, "free.consistency_summary.csv"))
    assert list(summary.loc[summary["odd"], "source"]) == ["card2.h5"]
