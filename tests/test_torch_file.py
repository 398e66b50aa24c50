"""Tensors saved by torch.save (msprobe's .pt files) read without torch and without running
code from the file (srdd_dump/format/torch_file.py)."""

from __future__ import annotations

import os
import pickle
import zipfile

import numpy as np
import pytest
import torch

from srdd_dump.errors import UserError
from srdd_dump.format.torch_file import read_tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int64, torch.bool])
def test_a_saved_tensor_reads_back_exactly(tmp_path, dtype):
    torch.manual_seed(0)
    t = (torch.randn(2, 5, 7) * 100).to(dtype)
    path = str(tmp_path / "t.pt")
    torch.save(t, path)
    want = t.float().numpy() if dtype == torch.bfloat16 else t.numpy()
    got = read_tensor(path)
    assert got.shape == want.shape and np.array_equal(got, want)


def test_views_keep_their_offset_and_strides(tmp_path):
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    for i, view in enumerate((base.transpose(0, 2), base[1:, ::2, 1:4], base[2])):
        path = str(tmp_path / f"v{i}.pt")
        torch.save(view, path)
        assert np.array_equal(read_tensor(path), view.numpy())


def _zip_with(tmp_path, payload: bytes) -> str:
    path = str(tmp_path / "evil.pt")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("evil/data.pkl", payload)
    return path


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch should_never_exist",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    path = _zip_with(tmp_path, pickle.dumps(_RunsCode(), protocol=2))
    with pytest.raises(UserError, match="refused"):
        read_tensor(path)
    assert not os.path.exists("should_never_exist")


def test_damaged_and_foreign_files_get_one_line(tmp_path):
    path = str(tmp_path / "t.pt")
    torch.save(torch.ones(100), path)
    data = open(path, "rb").read()
    cut = str(tmp_path / "cut.pt")
    with open(cut, "wb") as fh:
        fh.write(data[: len(data) // 2])
    foreign = str(tmp_path / "notes.pt")
    with open(foreign, "w") as fh:
        fh.write("not a tensor")
    for bad in (cut, foreign, _zip_with(tmp_path, pickle.dumps({"a": 1}, protocol=2))):
        with pytest.raises(UserError) as err:
            read_tensor(bad)
        assert "\n" not in str(err.value)
