"""Test markers: ``unit`` (in-process, no model, no command; seconds in all) and
``integration`` (runs the commands, a model, worker processes or the fuzzer). ``make test`` runs
both; ``pytest -m unit`` is the quick loop while editing; ``capture`` marks the modules run again
on the oldest supported transformers.

Modules of integration tests say so with ``pytestmark = pytest.mark.integration``; every other
test is marked ``unit`` here. (tests/ and fixtures/ are on the path through pyproject.toml.)
"""

from __future__ import annotations

import pytest

# Modules that exercise capture against the installed transformers: `make test` runs them again
# in .venv-oldest, on the oldest transformers of the tested range (srdd_dump/capture/versions.py).
# Left out there: test_moe*, test_tensor_parallel (fused experts and DistributedConfig are
# transformers 5 features) and test_compiled (its fullgraph fixture fails on 4.x without capture).
CAPTURE_MODULES = {
    "test_canary", "test_capture", "test_degradation", "test_exec", "test_faults",
    "test_identities", "test_import_order", "test_probes", "test_reliability", "test_serving",
    "test_serving_engine", "test_smollm2_e2e", "test_stats_store", "test_versions",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.unit)
        if item.module.__name__.rsplit(".", 1)[-1] in CAPTURE_MODULES:
            item.add_marker(pytest.mark.capture)
