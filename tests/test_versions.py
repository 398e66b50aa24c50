"""The tested transformers and torch ranges are stated once in each place that needs them, and
each test environment of `make test` runs the end of the ranges it claims."""

from __future__ import annotations

import os
import re

import pytest

from srdd_dump.capture.versions import TESTED, version_tuple

from capture_utils import ROOT

pytestmark = pytest.mark.capture


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
        return fh.read()


def test_pyproject_and_makefile_state_the_tested_range():
    oldest, newest = TESTED["transformers"]
    assert f'"transformers>={oldest},<={newest}"' in _read("pyproject.toml")
    assert re.search(rf"^TRANSFORMERS_OLDEST := {re.escape(oldest)}$", _read("Makefile"), re.M)
    last4 = re.search(r"^TRANSFORMERS_LAST4 := (\S+)$", _read("Makefile"), re.M).group(1)
    assert version_tuple(oldest) < version_tuple(last4) < version_tuple(newest)
    assert version_tuple(last4)[0] == 4  # the last release of transformers 4, inside the range
    oldest, newest = TESTED["torch"]
    assert re.search(rf"^TORCH_OLDEST := {re.escape(oldest)}$", _read("Makefile"), re.M)
    assert f"torch=={newest}" in _read("Makefile")  # what `make install` puts in .venv
    assert f'"torch>={".".join(oldest.split(".")[:2])}"' in _read("pyproject.toml")


def test_this_environment_runs_the_end_of_the_range_it_claims():
    end = os.environ.get("SRDD_TEST_TRANSFORMERS")
    if end is None:
        pytest.skip("SRDD_TEST_TRANSFORMERS is set by `make test` only")
    import torch
    import transformers

    oldest, newest = TESTED["transformers"]
    last4 = re.search(r"^TRANSFORMERS_LAST4 := (\S+)$", _read("Makefile"), re.M).group(1)
    assert transformers.__version__ == {"oldest": oldest, "newest": newest, "last4": last4}[end]
    oldest, newest = TESTED["torch"]
    want = {"oldest": oldest, "newest": newest, "last4": newest}[end]
    assert version_tuple(torch.__version__) == version_tuple(want), torch.__version__
