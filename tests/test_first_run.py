"""What a new user meets first: run folders, the choice of run, the first screen, where the
in-code API wrote, the default number of compare processes."""

from __future__ import annotations

import calendar
import os
import re

import numpy as np
import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.compare import compare_path, pipeline
from srdd_dump.compare.sources import DumpFile
from srdd_dump.errors import UserError
from srdd_dump.report.terminal import diagnosis_text

from capture_utils import py, run_cli
from dumpfactory import normal_rounds, write_dump
from tiny_models import build

RNG = np.random.default_rng(5)


def _run(folder, name: str, when: float, layers=(-1, 0, 1)) -> str:
    """A dump file in run folder ``name`` of ``folder``, modified at time ``when``."""
    os.makedirs(os.path.join(folder, name), exist_ok=True)
    path = write_dump(os.path.join(folder, name, "srdd_rank0_pid1.h5"),
                      normal_rounds(RNG, layers=layers))
    os.utime(path, (when, when))
    return path


# -- the choice of run ---------------------------------------------------------------------------


def test_a_folder_of_runs_compares_the_newest_and_says_so(tmp_path):
    _run(tmp_path, "srdd_dump_20261101_000000", 1_000_000, layers=(-1, 0, 1, 2))
    _run(tmp_path, "srdd_dump_20261102_000000", 2_000_000)
    result = compare_path(str(tmp_path), progress=False)
    assert set(result.layers["source"]) == {"srdd_dump_20261102_000000/srdd_rank0_pid1.h5"}
    (note,) = result.notes
    assert "2 runs" in note and "newest, srdd_dump_20261102_000000" in note
    assert "--run" in note and "srdd_dump_20261101_000000" in note

    older = compare_path(str(tmp_path), progress=False, run="srdd_dump_20261101_000000")
    assert older.notes == [] and len(older.layers) == 3
    both = compare_path(str(tmp_path), progress=False, run="all")
    assert len(both.files) == 2 and len(both.layers) == 5
    with pytest.raises(UserError, match="--run nope: no run of that name.*srdd_dump_2026110"):
        compare_path(str(tmp_path), progress=False, run="nope")


def test_a_run_written_inside_another_runs_folder_is_another_run(tmp_path):
    """`srdd-dump -o dumps/srdd_dump_A` nests the new run in A: both were read as cards of
    one run. They compete as runs of the folder: the newest is compared, the note names
    the other."""
    outer = "srdd_dump_20261101_000000"
    _run(tmp_path, outer, 1_000_000, layers=(-1, 0, 1, 2))
    _run(tmp_path / outer, "srdd_dump_20261101_000500", 1_000_300)
    result = compare_path(str(tmp_path), progress=False)
    assert set(result.layers["source"]) == {
        f"{outer}/srdd_dump_20261101_000500/srdd_rank0_pid1.h5"}
    (note,) = result.notes
    assert "holds 2 runs; comparing the newest" in note and outer in note
    assert len(compare_path(str(tmp_path), progress=False, run=outer).layers) == 3


def test_the_newest_run_is_the_one_its_name_says_even_after_a_copy(tmp_path):
    """Copies without -p (scp, cp) give every file a new time: the run folder's name keeps the
    run's own UTC time."""
    _run(tmp_path, "srdd_dump_20261102_000000", 1_000_000)  # copied first
    _run(tmp_path, "srdd_dump_20261101_000000", 2_000_000, layers=(-1, 0, 1, 2))
    result = compare_path(str(tmp_path), progress=False)
    assert set(result.layers["source"]) == {"srdd_dump_20261102_000000/srdd_rank0_pid1.h5"}


def test_an_old_flat_dump_and_a_new_run_in_one_folder_are_not_mixed(tmp_path):
    flat = write_dump(str(tmp_path / "srdd_rank0_pid7.h5"), normal_rounds(RNG))
    os.utime(flat, (1_000_000, 1_000_000))
    _run(tmp_path, "srdd_dump_20261102_000000", 2_000_000)
    result = compare_path(str(tmp_path), progress=False)
    assert list(result.files["source"]) == ["srdd_dump_20261102_000000/srdd_rank0_pid1.h5"]
    assert "--run NAME for another (.) or --run all" in result.notes[0]
    older = compare_path(str(tmp_path), progress=False, run=".")
    assert list(older.files["source"]) == ["srdd_rank0_pid7.h5"]
    # the golden side's note names its own option
    from srdd_dump.compare.sources import find_sources

    assert "--baseline-run NAME for another (.)" in find_sources(
        str(tmp_path), "--baseline ").note
    # a flat dump written after the run folder's start time is the newer run
    later = calendar.timegm((2026, 11, 3, 0, 0, 0, 0, 0, 0))
    os.utime(flat, (later, later))
    newer = compare_path(str(tmp_path), progress=False)
    assert list(newer.files["source"]) == ["srdd_rank0_pid7.h5"]
    assert "--run NAME for another (srdd_dump_20261102_000000)" in newer.notes[0]


def test_runs_of_different_hosts_are_compared_together(tmp_path):
    _run(tmp_path / "host0", "srdd_dump_20261102_000000", 2_000_000)
    _run(tmp_path / "host1", "srdd_dump_20261102_000003", 2_000_000)
    result = compare_path(str(tmp_path), progress=False)
    # one run: no note on runs; the two hosts ran the same inputs, too few for the card check
    (note,) = result.notes
    assert "multi-card check needs 3" in note and len(result.files) == 2


def test_runs_of_different_folders_started_hours_apart_are_compared_saying_so(tmp_path):
    """exp1/ and exp2/ each holding a run of its own day: still compared together (the layout
    of one run's hosts), but one line says they started hours apart and how to pick one."""
    _run(tmp_path / "exp1", "srdd_dump_20261102_000000", 2_000_000)
    _run(tmp_path / "exp2", "srdd_dump_20261102_020000", 2_000_000)
    result = compare_path(str(tmp_path), progress=False)
    (note,) = [n for n in result.notes if "apart" in n]
    assert "started 2.0 h apart (separate runs?); --run NAME compares one" in note
    assert len(result.files) == 2
    one = compare_path(str(tmp_path), progress=False, run="srdd_dump_20261102_020000")
    assert len(one.files) == 1 and not any("apart" in n for n in one.notes)


def test_a_flat_dump_folder_is_one_run(tmp_path):
    for rank in range(2):
        write_dump(str(tmp_path / f"srdd_rank{rank}_pid{rank}.h5"), normal_rounds(RNG))
    result = compare_path(str(tmp_path), progress=False)
    (note,) = result.notes  # no note on runs; the two ranks' inputs are the same
    assert note.startswith("srdd_rank0_pid0.h5 and srdd_rank1_pid1.h5 ran the same model")
    assert len(result.files) == 2


def test_the_cli_prints_which_run_and_baseline_runs_are_chosen_too(tmp_path):
    _run(tmp_path / "npu", "srdd_dump_a", 1_000_000)
    _run(tmp_path / "npu", "srdd_dump_b", 2_000_000)
    _run(tmp_path / "gpu", "srdd_dump_c", 1_000_000)
    _run(tmp_path / "gpu", "srdd_dump_d", 2_000_000)
    done = run_cli("srdd-compare", str(tmp_path / "npu"), "-o", str(tmp_path / "r.csv"), "-q")
    assert done.returncode == 0, done.stderr
    assert re.search(r"^srdd-compare: note: .*npu holds 2 runs; comparing the newest, "
                     r"srdd_dump_b", done.stderr, re.M)
    done = run_cli("srdd-compare", str(tmp_path / "npu"), "--baseline", str(tmp_path / "gpu"),
                   "--run", "srdd_dump_a", "--baseline-run", "srdd_dump_c", "-o",
                   str(tmp_path / "b.csv"), "-q")
    assert done.returncode == 0, done.stderr
    assert "note" not in done.stderr
    wrong = run_cli("srdd-compare", str(tmp_path / "npu"), "--baseline", str(tmp_path / "gpu"),
                    "--baseline-run", "nope", "-o", str(tmp_path / "c.csv"), "-q")
    assert wrong.returncode == 2 and "error: --baseline-run nope: no run of that name under "\
        "--baseline " in wrong.stderr, wrong.stderr
    import pandas as pd

    table = pd.read_csv(tmp_path / "b.csv")
    assert set(table["source"]) == {"srdd_dump_a/srdd_rank0_pid1.h5"}
    assert set(table["golden_source"]) == {"srdd_dump_c/srdd_rank0_pid1.h5"}


@pytest.mark.integration
def test_each_srdd_dump_run_gets_its_own_folder(tmp_path):
    out = tmp_path / "dumps"
    for _ in range(2):
        done = run_cli("srdd-dump", "--exec", py("infer_tiny.py", "llama"), "-o", str(out),
                       "--probes", "none", "--min-free-gb", "0", "-q")
        assert done.returncode == 0, done.stderr
        folder = re.search(r"run folder (\S+) \(1 file\)", done.stderr).group(1)
        assert os.path.dirname(folder) == str(out)
        assert os.path.basename(folder).startswith("srdd_dump_")
    runs = sorted(os.listdir(out))
    assert len(runs) == 2 and all(len(os.listdir(out / r)) == 1 for r in runs)
    result = compare_path(str(out), progress=False)
    assert runs[1] in result.notes[0]


# -- the first screen ----------------------------------------------------------------------------


def _session(tmp_path, inject=(), **options):
    model = build("llama", layers=4)
    gen = torch.Generator().manual_seed(0)
    config = DumpConfig(dump_path=str(tmp_path), granularity="sublayer", inject=list(inject),
                        progress=False, **options)
    with register_hook(model, config) as session, torch.no_grad():
        for n in (20, 27):
            model(input_ids=torch.randint(0, 128, (1, n), generator=gen))
    return session


@pytest.mark.integration
def test_healthy_first_screen_is_one_line_and_counts(tmp_path):
    _session(tmp_path)
    result = compare_path(str(tmp_path), progress=False)
    text = diagnosis_text(result)
    first = text.splitlines()[0]
    assert first.endswith("no faulty layer found in 4 layers x 2 samples, 1 probed (prefill "
                          "only: no decode step was captured)"), text
    assert "layers: 4 rows: 0 FAULT, 0 SUSPECT, 4 NORMAL" in text
    assert "NORMAL  " not in text and "flagged" not in text  # no table of NORMAL rows


@pytest.mark.integration
@pytest.mark.parametrize("options, says", [
    ({"probe_samples": 2}, "x 2 samples"), ({"probes": "none"}, "x 2 samples, none probed")])
def test_healthy_first_screen_says_how_many_samples_were_probed(tmp_path, options, says):
    _session(tmp_path, **options)
    first = diagnosis_text(compare_path(str(tmp_path), progress=False)).splitlines()[0]
    assert first.endswith(f"no faulty layer found in 4 layers {says} (prefill only: no decode "
                          "step was captured)"), first


@pytest.mark.integration
@pytest.mark.parametrize("options, says", [
    ({"repeats": 0}, "run-to-run repeats"), ({"draws": 0}, "noise gain"),
    ({"dc": []}, "dc response"),
    ({"probes": "gain,dc,repeat"}, "causality, host references")])
def test_a_healthy_verdict_says_which_probes_the_capture_left_out(tmp_path, options, says):
    """A capture that switched probe families off (--repeats 0, --probes gain,dc,repeat) did
    not test the faults only they show: the healthy first line says so, the default none."""
    _session(tmp_path, **options)
    first = diagnosis_text(compare_path(str(tmp_path), progress=False)).splitlines()[0]
    assert "no faulty layer found" in first
    assert first.endswith(f"; not tested (left out at capture): {says}"), first


@pytest.mark.integration
def test_faulty_first_screen_quotes_the_strongest_evidence(tmp_path):
    _session(tmp_path, inject=["dead_zone@layer=2,m=0.3,sparsity=0.2,site=mlp"])
    result = compare_path(str(tmp_path), progress=False)
    text = diagnosis_text(result)
    first = text.splitlines()[0]
    top = result.layers.iloc[0]
    # the evidence column lists every finding as "text [strength x]"; the headline quotes the
    # strongest dead-zone finding with its strength
    zeros = [float(x) for x in re.findall(r"exact zeros[^\[]*\[([0-9.e+]+)x\]", top["evidence"])]
    assert "Layer 2 (" in first and "FAULT - dead zone" in first and "exact zeros" in first
    got = float(re.search(r"\(([0-9.e+]+)x the FAULT limit\)", first).group(1))
    assert got == pytest.approx(max(zeros), rel=0.05)  # the evidence column has 2 digits
    assert "flagged layers" in text and "evidence:" not in text
    assert "evidence:" in diagnosis_text(result, explain=True)


# -- the in-code API says where it wrote --------------------------------------------------------


@pytest.mark.integration
def test_in_code_session_prints_and_keeps_its_path(tmp_path, capsys):
    session = _session(tmp_path)
    err = capsys.readouterr().err
    assert session.path and os.path.exists(session.path)
    assert f"srdd-dump: wrote {session.path}" in err.splitlines()


# -- default processes ---------------------------------------------------------------------------


def test_default_jobs_follow_the_usable_cores_and_the_work(tmp_path, monkeypatch):
    small = tmp_path / "small.h5"
    small.write_bytes(b"x" * 1000)
    big = tmp_path / "big.h5"
    with open(big, "wb") as fh:
        fh.truncate(10 * pipeline.BYTES_PER_JOB)  # sparse: no disk used
    monkeypatch.setattr(pipeline, "usable_cores", lambda: 4)
    assert pipeline.default_jobs([DumpFile(str(small), "s")]) == 1
    assert pipeline.default_jobs([DumpFile(str(big), "b")]) == 4
    monkeypatch.setattr(pipeline, "usable_cores", lambda: 2)
    assert pipeline.default_jobs([DumpFile(str(big), "b")]) == 2


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no affinity masks")
def test_usable_cores_reads_the_affinity_mask():
    assert pipeline.usable_cores() == len(os.sched_getaffinity(0))
