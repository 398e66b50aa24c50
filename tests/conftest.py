"""Test markers: ``unit`` (in-process, no model, no command; seconds in all) and
``integration`` (runs the commands, a model, worker processes or the fuzzer). ``make test`` runs
both; ``pytest -m unit`` is the quick loop while editing. ``capture`` (a module's ``pytestmark``)
marks the modules that exercise capture against the installed transformers: `make test` runs
them again in .venv-oldest, on the oldest transformers and torch of the tested ranges, and in
.venv-last4, on the last transformers 4. Not marked:
test_moe*, test_tensor_parallel (fused experts and DistributedConfig are transformers 5
features).

Modules of integration tests say so with ``pytestmark = pytest.mark.integration``; every other
test is marked ``unit`` here. (tests/ and fixtures/ are on the path through pyproject.toml.)
"""

from __future__ import annotations

import os

import pytest

# The commands' free-space gate (2 GB by default) is tested where it is the subject
# (test_reliability.py); elsewhere a CI machine with a small disk must not refuse the tests' dumps
# of tiny models, which take a few MB.
os.environ.setdefault("SRDD_DUMP_MIN_FREE_GB", "0")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.unit)
