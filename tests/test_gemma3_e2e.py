"""The second real architecture end to end: Gemma 3 270M from the PyPI part wheels
(fixtures/gemma3.py) through `srdd-dump --exec` and `srdd-compare`, as a user runs them
(issue 28): a healthy run has no FAULT and its attention and MLP references all ran (sliding
window and full attention layers, q/k norms, one KV head); a fault inside the attention kernel
of a sliding-window layer, at decode only, is named at that layer's attention."""

from __future__ import annotations

import pandas as pd
import pytest

from capture_utils import py, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.integration]

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:  # Gemma 3 needs transformers >= 4.50
    pytest.skip("Gemma 3 is run with the newest transformers", allow_module_level=True)


@pytest.fixture(scope="module")
def gemma3_cache():
    from gemma3 import ensure_cache

    return ensure_cache()


def _run(tmp_path, *options: str) -> tuple[pd.DataFrame, str]:
    dumps = tmp_path / "dumps"
    res = run_cli("srdd-dump", "--exec",
                  py("infer_gemma3.py", "--prompts", "2", "--new-tokens", "4"),
                  "-o", str(dumps), *options)
    assert res.returncode == 0, res.stderr
    report = tmp_path / "report.csv"
    res = run_cli("srdd-compare", str(dumps), "-o", str(report))
    assert res.returncode == 0, res.stderr
    return pd.read_csv(report), res.stdout + res.stderr


def test_healthy_gemma3_has_no_fault_and_every_reference_ran(gemma3_cache, tmp_path):
    table, text = _run(tmp_path)
    assert len(table) == 18 and (table["verdict"] != "FAULT").all(), table.head()
    assert "references" not in text  # no "evidence missing" line about them


def test_a_decode_mask_bug_in_a_sliding_window_layer_is_named(gemma3_cache, tmp_path):
    table, _ = _run(tmp_path, "--inject", "mask_shift@layer=8")
    top = table.iloc[0]
    assert (top["verdict"], int(top["layer"])) == ("FAULT", 8), table.head()
    assert top["site"] == "model.layers.8.self_attn"
    assert top["diagnosis"].split(",")[0] == "ATTENTION_MISMATCH"
    assert (table["verdict"] == "FAULT").sum() == 1
