"""The default report's hunt command (compare/hunt.py): a FAULT the default scan names at a
block or sub-layer comes with the srdd-dump command that captures that one layer's operators,
and that command, run as printed, names the operator."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pandas as pd
import pytest

from srdd_dump import DumpConfig
from srdd_dump.compare.hunt import hunt_command
from srdd_dump.compare.sources import DumpFile

from capture_utils import FIXTURES, run_cli

HUNT = "to name the operator inside it, capture that layer's operators: "


def _file(**options) -> DumpFile:
    f = DumpFile(path="x.h5", source="x.h5")
    f.layers = [f"model.layers.{k}" for k in range(4)]
    f.sites = ["model.layers.2.mlp", "model.layers.2.mlp.act_fn"]
    f.site_roles = ["sublayer", "act"]
    f.capture_options = {"granularity": "sublayer", "dump_path": "/d/srdd_dump_1", "samples": 2,
                         "command": "python infer.py --n 2", "probe_steps": "0,1,7",
                         **options}
    return f


@pytest.mark.unit
def test_the_hunt_is_one_layer_with_the_runs_options():
    f = _file(inject=["dead_zone@layer=2,site=mlp.act_fn", "noise@layer=3,m=1",
                      "bias@layer=-2,m=2"])
    words = shlex.split(hunt_command(f, 2, "model.layers.2.mlp"))
    assert words[:5] == ["srdd-dump", "--exec", "python infer.py --n 2", "-o", "/d"]
    assert words[-6:] == ["--granularity", "op", "--reference", "host", "--layers",
                          "model.layers.2"]
    assert "--samples" in words and words[words.index("--samples") + 1] == "2"
    # the faults of that layer, by the model's number of the hunt's one block (a negative
    # position made that number); the others cannot go along
    injected = [words[i + 1] for i, w in enumerate(words) if w == "--inject"]
    assert injected == ["dead_zone@layer=2,site=mlp.act_fn", "bias@layer=2,m=2"]
    # blocks without numbers in their names: the hunt's one block is its layer 0
    unnamed = _file(inject=["bias@layer=2,m=2"])
    unnamed.layers = ["encoder.first", "encoder.second", "encoder.third", "encoder.last"]
    words = shlex.split(hunt_command(unnamed, 2, "model.layers.2.mlp"))
    assert words[words.index("--inject") + 1] == "bias@layer=0,m=2"
    assert hunt_command(f, 2, "model.layers.2.mlp.act_fn") is None  # an operator: named
    assert hunt_command(_file(granularity="op"), 2, "model.layers.2") is None
    assert words[words.index("--probe-steps") + 1] == "0,1,7"
    # an in-code register_hook run records no command to re-run: its hunt is the DumpConfig
    # of that layer's operators, written to a folder of its own
    in_code = hunt_command(_file(command=None, dump_path="runs/d", inject=["noise@layer=2"]),
                           2, "model.layers.2")
    assert in_code.startswith("register_hook(model, DumpConfig(") and in_code.endswith("))")
    config = eval(in_code[len("register_hook(model, "):-1], {"DumpConfig": DumpConfig})
    assert (config.dump_path, config.granularity, config.reference, config.layers,
            config.samples, config.probe_steps, config.inject) == (
        os.path.normpath("runs/d_hunt"), "op", "host", "model.layers.2", 2, "0,1,7",
        ["noise@layer=2"])
    # a run that probed no sample: its hunt's host replays need one (DumpConfig refuses 0)
    words = shlex.split(hunt_command(_file(probe_samples=0), 2, "model.layers.2"))
    assert words[words.index("--probe-samples") + 1] == "1"
    assert "probe_samples=1" in hunt_command(_file(command=None, probe_samples=0), 2,
                                             "model.layers.2")
    # a dump that says where its command ran: the hunt runs there too (any folder quoted)
    there = shlex.split(hunt_command(_file(command_dir="/home/u/my proj"), 2, "model.layers.2"))
    assert there[:4] == ["cd", "/home/u/my proj", "&&", "srdd-dump"]


@pytest.mark.unit
def test_an_msprobe_dumps_hunt_names_the_program_to_run_once_more():
    """An msprobe dump records no command: the hunt names the user's script as a placeholder;
    an msprobe dump holding the layer's linear operators already (level mix, L1) gets none."""
    f = _file()
    f.capture_options, f.origin = {}, "/data/msprobe_npu"
    f.site_layers = {0: 2, 1: 2}
    words = shlex.split(hunt_command(f, 2, "model.layers.2.mlp"))
    assert words == ["srdd-dump", "--exec", "python <the script msprobe dumped>", "-o",
                     "dumps_hunt", "--granularity", "op", "--reference", "host", "--layers",
                     "model.layers.2"]
    f.sites.append("model.layers.2.mlp.down_proj")
    f.site_roles.append("linear")
    f.site_layers[2] = 2
    assert hunt_command(f, 2, "model.layers.2.mlp") is None
    assert hunt_command(f, 1, "model.layers.1") is not None  # another layer's are not there


@pytest.mark.integration
def test_the_printed_hunt_names_the_operator(tmp_path):
    fault = "dead_zone@layer=2,site=mlp.act_fn,m=0.3"
    out = str(tmp_path / "dumps")
    first = run_cli("srdd-dump", "--exec", "python infer_tiny.py llama", "-o", out, "-q",
                    "--inject", fault, cwd=FIXTURES)
    assert first.returncode == 0, first.stderr[-2000:]
    report = run_cli("srdd-compare", out, "-o", str(tmp_path / "r.csv"))
    assert report.returncode == 0, report.stderr
    (line,) = [x for x in report.stdout.splitlines() if x.startswith(HUNT)]
    command = line[len(HUNT):]
    words = shlex.split(command)
    # from the folder the command ran in: its script is named relative to it
    assert words[:4] == ["cd", FIXTURES, "&&", "srdd-dump"] and "model.layers.2" in words
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    hunt = subprocess.run(["bash", "-c", command + " -q"], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=600)  # run as printed
    assert hunt.returncode == 0, hunt.stderr[-2000:]
    again = run_cli("srdd-compare", out, "-o", str(tmp_path / "h.csv"))  # the newest run
    top = pd.read_csv(tmp_path / "h.csv").iloc[0]
    assert top["verdict"] == "FAULT" and top["module"] == "model.layers.2"
    assert top["layer"] == 2  # the model's number of the one block the hunt captured
    assert top["site"] == "model.layers.2.mlp.act_fn", again.stdout
    assert HUNT not in again.stdout  # its operators are in the dump: nothing left to hunt


def _hunt_headline(tmp_path, fault: str) -> str:
    """The FAULT headline of a hunt's dump (layer 2's operators, float64 replays) of the
    tiny Llama with ``fault`` planted."""
    out = str(tmp_path / fault.split("@")[0])
    run = run_cli("srdd-dump", "--exec", "python infer_tiny.py llama", "-o", out, "-q",
                  "--inject", fault, "--granularity", "op", "--reference", "host",
                  "--layers", "model.layers.2", cwd=FIXTURES)
    assert run.returncode == 0, run.stderr[-2000:]
    report = run_cli("srdd-compare", out, "-o", str(tmp_path / "r.csv"))
    (line,) = [x for x in report.stdout.splitlines() if "FAULT" in x and ".h5:" in x]
    return line


@pytest.mark.integration
def test_a_hunt_whose_operators_agree_names_the_attention_kernel(tmp_path):
    """The hunt of a fault inside the attention kernel: its projections agree with their
    float64 replays, so the line says the fault is between them, in the kernel."""
    line = _hunt_headline(tmp_path, "softmax_precision@layer=2")
    assert "(model.layers.2.self_attn): FAULT" in line, line
    assert line.endswith("its operators (k_proj, o_proj, q_proj, v_proj) agree with their "
                         "float64 replays and show no fault of their own: the fault is in the "
                         "attention kernel (model.layers.2.self_attn.core: its rotary, scores, "
                         "softmax, mask or head mapping)"), line
    # a fault in one of those operators is named by it, with no such line
    line = _hunt_headline(tmp_path, "bias@layer=2,site=self_attn.v_proj,m=2")
    assert "agree with their float64 replays" not in line, line
