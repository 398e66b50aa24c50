"""Evidence the options ask for and the capture did not get is reported, never lost silently:
a probe broken on purpose, a granularity that finds nothing, both commands telling."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch import nn

from srdd_dump import DumpConfig, register_hook
from srdd_dump.capture import probes
from srdd_dump.compare import compare_path
from srdd_dump.format.coverage import Coverage, partial_lines, shortfall_lines
from srdd_dump.format.reader import DumpReader, find_dump_files
from srdd_dump.report.terminal import diagnosis_text

from capture_utils import FIXTURES, run_cli
from tiny_models import build

pytestmark = pytest.mark.capture


def _generate(model, seed: int = 0) -> None:
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)


def test_shortfalls_group_families_by_cause():
    cov = Coverage()
    for _ in range(4):
        cov.expect("decode block probes")
        cov.failed("decode block probes", "TypeError: update() got an unexpected keyword\nmore")
        cov.expect("decode attention probes")
        cov.failed("decode attention probes", "TypeError: update() got an unexpected keyword")
        cov.expect("prefill block probes")
        cov.ran("prefill block probes")
    cov.expect("prefill MLP probes", 4)
    for _ in range(3):
        cov.ran("prefill MLP probes")
    cov.failed("prefill MLP probes", "RuntimeError: one module refused")
    assert cov.shortfalls() == [
        "decode steps not probed: decode attention probes (0 of 4 calls), decode block probes "
        "(0 of 4 calls): TypeError: update() got an unexpected keyword"]
    assert partial_lines(cov.as_dict()) == [
        "prefill MLP probes ran on 3 of 4 calls: RuntimeError: one module refused"]
    assert shortfall_lines({}) == [] and shortfall_lines(None) == []


def test_a_later_file_of_a_serving_engine_counts_its_own_evidence():
    """A server finishes its file when idle and starts the next at a later request: the later
    file stored the whole process's counts ("decode MLP probes 30 of 30 done" in a file of one
    unprobed request) and srdd-compare repeated the first file's missing evidence under it.
    Each file stores its own counts; a process's files summed give its whole run's."""
    from srdd_dump.format.coverage import summed

    cov = Coverage()
    cov.expect("prefill MLP references", 30)
    cov.failed("prefill MLP references", "TypeError: no host weight")
    cov.expect("request samples", 3)
    for _ in range(3):
        cov.ran("request samples")
    first = cov.since({})
    assert first == cov.as_dict()
    filed = cov.snapshot()
    cov.expect("request samples")
    cov.ran("request samples")
    second = cov.since(filed)
    assert second == {"request samples": {"expected": 1, "done": 1, "first_error": None}}
    assert shortfall_lines(second) == []  # nothing of the first file said again
    assert shortfall_lines(first) == [
        "not obtained: prefill MLP references (0 of 30 calls): TypeError: no host weight"]
    assert summed([first, second]) == cov.as_dict()
    # a shortfall of a later file gives its own cause, not the first file's
    filed = cov.snapshot()
    cov.expect("prefill MLP references", 10)
    cov.failed("prefill MLP references", "RuntimeError: weight moved to the device")
    assert shortfall_lines(cov.since(filed)) == [
        "not obtained: prefill MLP references (0 of 10 calls): RuntimeError: weight moved "
        "to the device"]
    filed = cov.snapshot()
    cov.expect("prefill MLP references", 10)  # skipped without an error this time
    assert cov.since(filed)["prefill MLP references"]["first_error"] is None


@pytest.mark.unit
def test_a_long_cause_is_cut_between_words():
    """A vLLM user's evidence-missing line ended "...the attention metada...": the cause is cut
    at a space, never mid-word, and stays within its limit."""
    cov = Coverage()
    cov.expect("decode attention probes")
    cause = "RuntimeError: no " + " ".join(["attention metadata of this decode step"] * 12)
    cov.failed("decode attention probes", cause)
    kept = cov.as_dict()["decode attention probes"]["first_error"]
    assert len(kept) <= 200 and kept.endswith("...")
    assert cause.startswith(kept[:-3]) and cause[len(kept) - 3] == " ", kept


@pytest.mark.integration
def test_a_broken_decode_probe_is_reported_by_both_commands(tmp_path, monkeypatch, capsys):
    def broken(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("decode replay broken on purpose")

    monkeypatch.setattr(probes.FrozenCache, "update", broken)
    model = build("llama")
    with register_hook(model, DumpConfig(dump_path=str(tmp_path), samples=2,
                                         probe_samples=2)) as session:
        _generate(model)
        _generate(model, 1)
    err = capsys.readouterr().err
    assert ("evidence missing: decode steps not probed: decode attention probes (0 of 8 "
            "calls), decode block probes (0 of 8 calls)") in err
    assert "decode replay broken on purpose" in err
    assert err.count("broken on purpose") == 1  # the cause once, not once per family
    assert not any(line.startswith("prefill") for line in session.degraded)
    assert "MLP" not in err  # an MLP replay needs no cache: its decode probes ran
    with DumpReader(session.path) as r:
        coverage = r.status["coverage"]
    assert coverage["decode block probes"]["done"] == 0
    # samples x probed decode steps (1: the default --probe-steps 0,1) x layers
    assert coverage["decode block probes"]["expected"] == 2 * 1 * 4
    assert coverage["prefill block probes"]["done"] == coverage["prefill block probes"][
        "expected"] == 2 * 4

    result = compare_path(str(tmp_path), progress=False)
    (line,) = result.missing_evidence
    assert "decode attention probes (0 of 8 calls)" in line and "broken on purpose" in line
    assert "decode block probes (0 of 8 calls)" in line
    screen = diagnosis_text(result)
    assert "evidence missing from these verdicts" in screen
    assert screen.index("evidence missing") < screen.index("layers:")  # the first screen


@pytest.mark.integration
def test_decode_steps_run_without_their_cache_are_named_as_such(tmp_path):
    # a decoding loop that drops its cache: each one-token call gets a fresh, empty cache
    # from the model; the decode replays cannot be made and the reason says why
    model = build("llama")
    ids = torch.tensor([[5, 17, 33, 2, 91, 40, 7, 66]])
    with register_hook(model, DumpConfig(dump_path=str(tmp_path), samples=1)) as session, \
            torch.no_grad():
        mask = torch.ones_like(ids)
        x = ids
        for _ in range(3):
            x = model(input_ids=x, attention_mask=mask, use_cache=True).logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(x)], dim=1)
    failed = session.coverage.as_dict()["decode block probes"]
    assert failed["done"] == 0 and failed["expected"] > 0
    assert "holds no earlier keys and values" in failed["first_error"], failed


@pytest.mark.unit
def test_a_cache_that_cannot_be_kept_is_described_by_its_cause():
    class Other:  # a cache class of another layout (no layers, no key_cache)
        def update(self, *args, **kwargs):
            raise AssertionError("never called")

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 4

    assert probes.snapshot_cache(0, (), {"past_key_values": Other()}) == (
        "a cache layout srdd-dump does not know (Other)")
    legacy = ((torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)),)
    assert "not a Cache object" in probes.snapshot_cache(0, (), {"past_key_values": legacy})


@pytest.mark.integration
def test_healthy_capture_reports_nothing_missing(tmp_path, capsys):
    model = build("qwen2")
    with register_hook(model, DumpConfig(dump_path=str(tmp_path), samples=1)) as session:
        _generate(model)
    assert session.degraded == []
    assert "evidence missing" not in capsys.readouterr().err
    with DumpReader(session.path) as r:
        coverage = r.status["coverage"]
    for family in ("prefill block probes", "decode block probes", "prefill attention probes",
                   "decode attention probes", "prefill MLP probes", "decode MLP probes"):
        assert coverage[family]["done"] == coverage[family]["expected"] > 0, family
    result = compare_path(str(tmp_path), progress=False)
    assert result.missing_evidence == []
    assert "evidence missing" not in diagnosis_text(result)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return x + torch.tanh(x @ self.weight)


class _Opaque(nn.Module):
    """Blocks with no attention, MLP or operator module inside (one fused kernel each)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("granularity,family", [("sublayer", "sub-layer sites"),
                                                ("op", "operator sites")])
def test_a_granularity_that_finds_nothing_is_reported(granularity, family, tmp_path, capsys):
    model = _Opaque()
    config = DumpConfig(dump_path=str(tmp_path), granularity=granularity)
    with register_hook(model, config) as session, torch.no_grad():
        model(torch.randn(1, 5, 16))
    (line,) = [d for d in session.degraded if family in d]
    assert f"{family} (0 of 3 blocks)" in line and "found inside the blocks" in line
    assert "evidence missing" in capsys.readouterr().err
    assert DumpConfig().granularity == "sublayer"  # so the default asks for sub-layers


@pytest.mark.integration
def test_exec_ends_with_the_missing_evidence_line(tmp_path):
    script = tmp_path / "infer.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {FIXTURES!r})
        from transformers import LlamaConfig  # noqa: F401  (a user's usual first line)
        import torch
        from srdd_dump.capture import probes

        def broken(self, *args, **kwargs):
            raise RuntimeError("decode replay broken on purpose")

        probes.FrozenCache.update = broken
        from tiny_models import build

        model = build("llama")
        ids = torch.randint(0, 128, (1, 9))
        with torch.no_grad():
            model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    """))
    out = tmp_path / "dumps"
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(out),
                  "--quiet")
    assert res.returncode == 0, res.stderr  # the dump is usable; what it lacks is said
    warnings = [line for line in res.stderr.splitlines() if "evidence missing" in line]
    assert len(warnings) == 1, res.stderr
    assert "decode block probes (0 of 4 calls)" in warnings[0]  # 4 layers x decode step 1
    assert "RuntimeError: decode replay broken on purpose" in warnings[0]
    assert find_dump_files(str(out))
    res = run_cli("srdd-compare", str(out), "-o", str(tmp_path / "report.csv"))
    assert res.returncode == 0, res.stderr
    screen = res.stdout
    assert "evidence missing from these verdicts" in screen
    assert "decode block probes (0 of 4 calls)" in screen


def test_a_library_outside_the_tested_range_is_named():
    from srdd_dump.capture.versions import TESTED, untested, version_tuple

    oldest, newest = TESTED["transformers"]
    assert version_tuple("4.57.0.dev0") == (4, 57, 0) and version_tuple("5.24.0rc1") == (5, 24, 0)
    assert untested("transformers", oldest) is None and untested("transformers", newest) is None
    major, minor = version_tuple(newest)[:2]
    note = untested("transformers", f"{major}.{minor + 1}.0")
    assert note.startswith(f"transformers {major}.{minor + 1}.0 is newer than the newest tested")
    assert "older than the oldest tested" in untested("transformers", "4.0.0")
    assert untested("transformers", None) is None and untested("numpy", "0.1") is None
