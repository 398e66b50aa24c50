"""Real msprobe dumps read as they are (srdd_dump/format/msprobe.py): fixtures/msprobe/."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from srdd_dump.errors import UserError
from srdd_dump.format.msprobe import is_msprobe_dump, read_msprobe

from capture_utils import FIXTURES

DUMP = os.path.join(FIXTURES, "msprobe", "smollm2_bf16")


def test_a_real_msprobe_dump_is_read_call_by_call():
    assert is_msprobe_dump(DUMP)
    (run,) = read_msprobe(DUMP)
    assert (run.step, run.rank, run.task, run.level) == (0, None, "tensor", "L0")
    assert len(run.calls) == 30 * 3 * 2  # decoder layer, attention and MLP; prefill + decode
    blocks = [c for c in run.calls if c.cls == "LlamaDecoderLayer"]
    assert {c.module for c in blocks} == {f"model.layers.{i}" for i in range(30)}
    assert {c.call for c in blocks} == {0, 1}
    prefill = next(c for c in blocks if c.module == "model.layers.5" and c.call == 0)
    x = run.tensor(prefill)
    assert list(x.shape) == prefill.output["shape"] and x.shape[1] > 1
    # the statistics msprobe wrote agree with the tensor read back
    assert x.max() == pytest.approx(prefill.output["Max"], rel=1e-6)
    assert x.min() == pytest.approx(prefill.output["Min"], rel=1e-6)
    # (msprobe computes the norm in the tensor's own dtype: bfloat16, 3 significant digits)
    assert float(np.linalg.norm(x.astype(np.float64))) == pytest.approx(
        prefill.output["Norm"], rel=1e-2)
    decode = next(c for c in blocks if c.module == "model.layers.5" and c.call == 1)
    assert run.tensor(decode).shape[1] == 1


def test_not_a_dump_and_a_damaged_one_get_one_line(tmp_path):
    assert not is_msprobe_dump(str(tmp_path))
    with pytest.raises(UserError, match="no msprobe dump.json"):
        read_msprobe(str(tmp_path))
    bad = tmp_path / "step0" / "rank0"
    bad.mkdir(parents=True)
    (bad / "dump.json").write_text("{not json")
    with pytest.raises(UserError) as err:
        read_msprobe(str(tmp_path))
    assert "dump.json" in str(err.value) and "\n" not in str(err.value)
    (bad / "dump.json").write_text(json.dumps({"framework": "mindspore", "data": {}}))
    with pytest.raises(UserError, match="mindspore"):
        read_msprobe(str(tmp_path))


def test_a_statistics_dump_has_no_tensors_to_read(tmp_path):
    copy = tmp_path / "stats"
    shutil.copytree(DUMP, copy)
    path = copy / "step0" / "proc4242" / "dump.json"
    doc = json.loads(path.read_text())
    for entry in doc["data"].values():
        for t in entry["output"]:
            if isinstance(t, dict):
                t.pop("data_name", None)
    doc["task"] = "statistics"
    path.write_text(json.dumps(doc))
    (run,) = read_msprobe(str(copy))
    assert not any(c.has_tensor for c in run.calls)
    with pytest.raises(UserError, match="no saved tensor"):
        run.tensor(run.calls[0])
