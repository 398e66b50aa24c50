"""Tensor parallel: SmolLM2-135M split over 3 ranks by transformers' ``tp_plan="auto"`` under
``torchrun`` (gloo, CPU), captured by ``srdd-dump --exec``; and the DTensor handling of
capture and of the fault simulator on a one-rank process group."""

from __future__ import annotations

import json
import os
import shlex
import sys
import textwrap
import threading

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist

from srdd_dump.capture import lockstep, parallel
from srdd_dump.capture.faults import _Fault, install_faults
from srdd_dump.capture.faultspec import parse_fault
from srdd_dump.errors import UserError
from srdd_dump.format import schema as s
from srdd_dump.format.reader import DumpReader, find_dump_files

from capture_utils import FIXTURES, run_cli, run_plain

pytestmark = pytest.mark.integration

# --standalone: a free rendezvous port, so parallel runs on one machine do not collide
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
SCRIPT_ARGS = ["--prompts", "2", "--new-tokens", "4"]
FAULT = "dead_zone@layer=5,site=block,rank=1,m=0.05"  # on rank 1 only
# rank 2 of this wrapper may write files of 3 MB at most: its capture stops after a round
LIMITED = """
import os, resource, runpy, sys
if os.environ.get("RANK") == "2":
    resource.setrlimit(resource.RLIMIT_FSIZE, (3_000_000, 3_000_000))
sys.argv[0] = {script!r}
sys.path.insert(0, os.path.dirname({script!r}))
runpy.run_path({script!r}, run_name="__main__")
"""


def tp_command(*extra: str) -> str:
    return shlex.join([*TORCHRUN, os.path.join(FIXTURES, "infer_tp.py"), *SCRIPT_ARGS, *extra])


def rank_tokens(out: str) -> list:
    result = []
    for rank in range(3):
        with open(f"{out}.rank{rank}") as fh:
            result.append(json.load(fh))
    return result


@pytest.fixture(scope="module")
def smollm2_cache():
    from smollm2 import ensure_cache

    return ensure_cache()


@pytest.fixture(scope="module")
def plain_tokens(smollm2_cache, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("plain") / "tokens.json")
    run_plain(shlex.split(tp_command("--out", out, "--out-per-rank")), attempts=2)
    return rank_tokens(out)


@pytest.mark.slow
def test_tp_dump_one_full_file_per_rank_and_the_same_tokens(plain_tokens, tmp_path):
    out = str(tmp_path / "tokens.json")
    dumps = tmp_path / "dumps"
    # the default granularity and probes: nothing may hang (replays of tensor-parallel
    # modules are skipped), and the answers stay bit-identical on every rank
    res = run_cli("srdd-dump", "--exec", tp_command("--out", out, "--out-per-rank"),
                  "-o", str(dumps), "--samples", "2")
    assert res.returncode == 0, res.stderr
    assert rank_tokens(out) == plain_tokens
    assert plain_tokens[0] == plain_tokens[1] == plain_tokens[2]

    files = find_dump_files(str(dumps))
    assert len(files) == 3
    blocks = {}
    for path in files:
        with DumpReader(path) as r:
            assert r.complete and not r.status["error"]
            tp = r.meta["tensor_parallel"]
            assert tp["world_size"] == 3 and tp["rank"] == r.meta["rank"]
            assert os.path.basename(path).startswith(f"srdd_rank{tp['rank']}_")
            assert tp["sharded_sites"] == {}  # attention and MLP outputs are all-reduced
            assert r.status["tp_replays_skipped"] > 0
            assert r.layers == [f"model.layers.{i}" for i in range(30)]
            assert r.meta["hidden_width"] == 576
            x = r.read(r.select(10, kind=s.KIND_CLEAN)[0])
            assert x.shape[-1] == 576 and x.std() > 0
            blocks[tp["rank"]] = x
    assert sorted(blocks) == [0, 1, 2]
    np.testing.assert_array_equal(blocks[0], blocks[1])  # the full, replicated hidden state
    np.testing.assert_array_equal(blocks[0], blocks[2])

    report = tmp_path / "report.csv"
    res = run_cli("srdd-compare", str(dumps), "-o", str(report))
    assert res.returncode == 0, res.stderr
    assert "all 3 sources agree" in res.stdout
    assert (pd.read_csv(report)["verdict"] == "NORMAL").all()


@pytest.mark.slow
def test_a_fault_on_one_rank_is_named_by_the_consistency_table(smollm2_cache, tmp_path):
    dumps = tmp_path / "dumps"
    res = run_cli("srdd-dump", "--exec", tp_command(), "-o", str(dumps), "--samples", "2",
                  "--granularity", "block", "--inject", FAULT)
    assert res.returncode == 0, res.stderr
    for path in find_dump_files(str(dumps)):
        with DumpReader(path) as r:
            faults = r.meta["injected_faults"]
            assert len(faults) == (1 if r.meta["rank"] == 1 else 0)

    report = tmp_path / "report.csv"
    res = run_cli("srdd-compare", str(dumps), "-o", str(report))
    assert res.returncode == 0, res.stderr
    summary = pd.read_csv(tmp_path / "report.consistency_summary.csv")
    summary["rank"] = summary["source"].str.extract(r"srdd_rank(\d)_")[0].astype(int)
    odd = summary[summary["odd"]]
    assert odd["rank"].tolist() == [1]
    assert int(odd["first_departing_layer"].iloc[0]) == 5
    assert "odd card out" in res.stdout and "first at layer 5" in res.stdout

    # without any other card, rank 1's own file names layer 5
    table = pd.read_csv(report)
    table["rank_"] = table["source"].str.extract(r"srdd_rank(\d)_")[0].astype(int)
    faults = table[table["verdict"] == "FAULT"]
    assert set(faults["rank_"]) == {1}
    assert faults.sort_values("score", ascending=False)["layer"].iloc[0] == 5


@pytest.mark.slow
def test_lockstep_replays_find_noise_on_one_rank_and_stop_when_a_rank_stops(
        smollm2_cache, tmp_path):
    """--tp-replays lockstep probes the tensor-parallel blocks on every rank at once (rank 1's
    noise shows as instability); when rank 2's capture stops (its file-size limit), the
    others stop replaying after SRDD_DUMP_TP_TIMEOUT instead of waiting for it forever."""
    wrapper = tmp_path / "limited.py"
    wrapper.write_text(textwrap.dedent(LIMITED.format(script=os.path.join(FIXTURES,
                                                                          "infer_tp.py"))))
    out = str(tmp_path / "tokens.json")
    command = shlex.join([*TORCHRUN, str(wrapper), *SCRIPT_ARGS, "--out", out,
                          "--out-per-rank"])
    dumps = tmp_path / "dumps"
    res = run_cli("srdd-dump", "--exec", command, "-o", str(dumps), "--samples", "2",
                  "--probe-samples", "2", "--granularity", "block", "--tp-replays", "lockstep",
                  "--inject", "noise@layer=5,site=block,rank=1,m=0.3",
                  env={"SRDD_DUMP_TP_TIMEOUT": "5"}, timeout=300)
    assert res.returncode == 3, res.stderr  # the program ran; rank 2's capture failed
    assert "file-size limit" in res.stderr
    tokens = rank_tokens(out)
    assert tokens[0] == tokens[1] == tokens[2]  # the logits are gathered: the same answers
    status = {}
    for path in find_dump_files(str(dumps)):
        with DumpReader(path) as r:
            status[r.meta["rank"]] = r.status
    for rank in (0, 1):
        assert status[rank]["tp_replays_lockstep"] > 0
        assert "within 5 s" in status[rank]["tp_lockstep_stopped"]
        assert status[rank]["tp_replays_skipped"] > 0  # after the stop: clean data only

    report = tmp_path / "report.csv"
    res = run_cli("srdd-compare", str(dumps), "-o", str(report))
    assert res.returncode == 0, res.stderr
    assert "lockstep replays stopped" in res.stderr
    table = pd.read_csv(report)
    faults = table[table["verdict"] == "FAULT"]
    assert faults["source"].str.contains("srdd_rank1_").all()
    assert faults.sort_values("score", ascending=False)["layer"].iloc[0] == 5
    assert (faults["diagnosis"] == "NOISE_SOURCE").any()


@pytest.mark.slow
def test_lockstep_sub_layers_say_why_they_have_no_float64_reference(smollm2_cache, tmp_path):
    """At the default granularity the lockstep replays reach the attention and MLP, whose
    weights each rank holds a part of: their float64 references cannot be made, and the end
    of the run says so in words (it printed torch's 'mixed torch.Tensor and DTensor')."""
    command = shlex.join([*TORCHRUN, os.path.join(FIXTURES, "infer_tp.py"), "--prompts", "1",
                          "--new-tokens", "2"])
    res = run_cli("srdd-dump", "--exec", command, "-o", str(tmp_path / "dumps"), "-q",
                  "--samples", "1", "--tp-replays", "lockstep", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "attention references (0 of" in res.stderr and "MLP references (0 of" in res.stderr
    assert "its weights are split over the tensor-parallel ranks" in res.stderr
    assert "mixed torch.Tensor and DTensor" not in res.stderr, res.stderr[-3000:]


def test_lockstep_agreement_leaves_no_rank_alone():
    """The store protocol behind --tp-replays lockstep: all arrive -> every rank replays; one
    never arrives -> nobody does, including a rank that arrives after the others gave up."""
    from torch.distributed import TCPStore

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def run(ranks, key, late=None):
        got = {}

        def one(rank):
            store = TCPStore("127.0.0.1", master.port, is_master=False)
            got[rank] = lockstep.agree(store, key, 3, 1.0)

        threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if late is not None:
            one(late)
        return got

    assert run([0, 1, 2], "a") == {0: True, 1: True, 2: True}
    assert run([0, 1], "b", late=2) == {0: False, 1: False, 2: False}
    assert run([0], "c") == {0: False}


# -- DTensor outputs and faults, on a one-rank process group (no torchrun) -----------------

@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from torch.distributed.device_mesh import init_device_mesh

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor_outputs_are_recorded_as_their_local_tensor(mesh, monkeypatch):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    x = torch.randn(1, 5, 8)
    model = torch.nn.Linear(8, 8)
    tp = parallel.TensorParallel(model, [model])
    assert not tp.active and tp.meta() is None  # one rank, no DTensor parameters
    for placement, kind in ((Replicate(), None), (Shard(-1), "shard"), (Partial(), "partial")):
        d = DTensor.from_local(x, mesh, [placement], run_check=False)
        got = tp.local(d, f"site.{kind}")
        assert not parallel.is_dtensor(got) and torch.equal(got, x)
        assert tp.sharded_sites.get(f"site.{kind}") == kind

    # a module with distributed parameters in a world of 3 is never replayed
    monkeypatch.setattr(parallel, "world", lambda: (1, 3))
    model.weight = torch.nn.Parameter(DTensor.from_local(model.weight.data, mesh, [Shard(0)]))
    other = torch.nn.LayerNorm(8)
    tp = parallel.TensorParallel(model, [model, other])
    assert tp.active and tp.meta()["rank"] == 1 and tp.meta()["world_size"] == 3
    assert not tp.may_replay(model) and tp.may_replay(other)
    assert not tp.may_host_replay(model) and tp.may_host_replay(other)
    assert tp.status() == {"tp_replays_skipped": 1, "tp_host_replays_skipped": 1}
    # a plain output narrower than the column-parallel map's out_features is its local shard,
    # and so is an operator's output of that width (an activation between the projections)
    act = torch.nn.SiLU()
    tp.local(torch.randn(1, 5, 6), "act_before", "act", act, 8)  # no such width seen yet
    tp.local(torch.randn(1, 5, 6), "q_proj", "linear", model, 8)
    tp.local(torch.randn(1, 5, 6), "act", "act", act, 8)
    tp.local(torch.randn(1, 5, 8), "norm", "norm", other, 8)
    tp.local(torch.randn(1, 5, 6), "rotary", "rotary", None, 8)
    tp.local(torch.randn(1, 5, 8), "full", "linear", model, 8)  # FSDP-like: full output
    assert tp.sharded_sites == {"q_proj": "shard", "act": "shard"}


def test_a_fault_on_a_dtensor_output_acts_on_the_local_tensor(mesh):
    from torch.distributed.tensor import DTensor, Shard

    x = torch.randn(1, 6, 8)
    d = DTensor.from_local(x, mesh, [Shard(-1)], run_check=False)
    fault = _Fault(parse_fault("dead_zone@layer=0,m=0.5"))
    out = fault(None, (), d)
    assert parallel.is_dtensor(out) and out.placements == d.placements
    np.testing.assert_array_equal(out.to_local().numpy(), fault_free(x, 0.5))


def fault_free(x: torch.Tensor, m: float) -> np.ndarray:
    a = x.numpy()
    return np.where(np.abs(a) < m * np.abs(a).max(), 0, a)


def test_rank_option_of_the_fault_simulator(monkeypatch):
    from tiny_models import build

    assert parse_fault("noise@layer=5,rank=1").options["rank"] == "1"
    with pytest.raises(UserError, match="rank"):
        parse_fault("noise@layer=5,rank=one")
    model = build("llama", layers=2)
    blocks = [(f"model.layers.{i}", b) for i, b in enumerate(model.model.layers)]
    spec = parse_fault("bias@layer=1,rank=2")
    for rank, installed in (("2", 1), ("0", 0)):
        monkeypatch.setenv("RANK", rank)
        handles, described = install_faults(model, blocks, [spec])
        assert len(handles) == len(described) == installed
        for h in handles:
            h.remove()
    with pytest.raises(UserError, match="out of range"):  # checked on every rank
        install_faults(model, blocks, [parse_fault("bias@layer=9,rank=2")])
