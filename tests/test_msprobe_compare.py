"""srdd-compare on the dumps users already have: a real msprobe dump (fixtures/msprobe) as the
input of the reference-free diagnosis and as the golden side of --baseline."""

from __future__ import annotations

import glob
import os

import pytest

from capture_utils import FIXTURES, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MSPROBE = os.path.join(FIXTURES, "msprobe", "smollm2_bf16")
# the run the msprobe dump recorded: prompt 0 in the chat template, 2 new tokens, bfloat16
SCRIPT = "python infer_smollm2.py --prompts 1 --new-tokens 2 --dtype bfloat16"


def _srdd_dump(tmp_path, *options: str) -> str:
    proc = run_cli("srdd-dump", "--exec", SCRIPT, "-o", str(tmp_path / "srdd"), "-q", *options,
                   cwd=FIXTURES)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run,) = glob.glob(str(tmp_path / "srdd" / "srdd_dump_*"))
    return run


def _compare(tmp_path, *args: str) -> str:
    proc = run_cli("srdd-compare", *args, "-o", str(tmp_path / "report.csv"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout + proc.stderr


def test_an_msprobe_dump_gets_a_reference_free_report(tmp_path):
    text = _compare(tmp_path, MSPROBE)
    assert "30 rows: 0 FAULT" in text
    assert "no probe replays" in text  # the report says which evidence was unavailable


def test_an_msprobe_dump_is_the_golden_side_of_a_baseline(tmp_path):
    text = _compare(tmp_path, _srdd_dump(tmp_path), "--baseline", MSPROBE)
    # both sides recorded the same computation: every block row compared passes
    assert "(2 compared rounds): 60 PASS, 0 WARN, 0 FAIL" in text, text


def test_a_fault_against_an_msprobe_golden_run_is_the_first_divergence(tmp_path):
    mine = _srdd_dump(tmp_path, "--inject", "dead_zone@layer=10,m=0.3,sparsity=0.1,site=mlp")
    text = _compare(tmp_path, mine, "--baseline", MSPROBE)
    finding = next(line for line in text.splitlines() if line.startswith("finding:"))
    assert "10 (model.layers.10" in finding and " 0 PASS" not in text, text
