"""End to end on the real SmolLM2-135M-Instruct: srdd-dump --exec, then srdd-compare."""

from __future__ import annotations

import json
import shlex

import pandas as pd
import pytest

from srdd_dump.format.reader import DumpReader, find_dump_files

from capture_utils import py, run_cli, run_plain

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.capture]


@pytest.fixture(scope="module")
def smollm2_cache():
    from smollm2 import ensure_cache

    return ensure_cache()


def test_real_model_dump_is_transparent_and_compares(smollm2_cache, tmp_path):
    plain, captured = tmp_path / "plain.json", tmp_path / "captured.json"
    run_plain(shlex.split(py("infer_smollm2.py", "--prompts", "3", "--new-tokens", "6",
                             "--out", str(plain))))
    dumps = tmp_path / "dumps"
    res = run_cli("srdd-dump", "--exec",
                  py("infer_smollm2.py", "--prompts", "3", "--new-tokens", "6", "--out",
                     str(captured)),
                  "-o", str(dumps), "--steps", "0-2")
    assert res.returncode == 0, res.stderr
    # Greedy generation gives the same token ids with and without capture.
    assert json.loads(plain.read_text()) == json.loads(captured.read_text())

    (path,) = find_dump_files(str(dumps))
    with DumpReader(path) as r:
        assert r.complete
        assert r.layers == [f"model.layers.{i}" for i in range(30)]
        assert r.meta["model_config"]["num_hidden_layers"] == 30
        assert r.n_samples == 3
        assert sorted(set(r.rounds["step"].tolist())) == [0, 1, 2]
        assert r.select(29).shape == (9,)  # 3 samples x 3 rounds
        x = r.read(r.select(10)[0])
        assert x.shape[-1] == 576 and x.std() > 0

    report = tmp_path / "report.csv"
    res = run_cli("srdd-compare", str(dumps), "-o", str(report))
    assert res.returncode == 0, res.stderr
    table = pd.read_csv(report)
    assert len(table) == 30 and set(table["layer"]) == set(range(30))
    assert (table["verdict"] == "NORMAL").all()  # a healthy model has no fault
    assert (table["samples"] == 3).all()
