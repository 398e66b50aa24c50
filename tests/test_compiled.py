"""Capture of torch.compile'd models (srdd_dump/capture/compiled.py): hooks present when the model
is traced run at graph breaks and record what eager capture records; a fullgraph compile runs
untouched; hooks registered too late, or compiled out, are said in one line, never an empty
dump in silence."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.analysis.diagnosis import FAULT
from srdd_dump.capture import compiled
from srdd_dump.compare import compare_path
from srdd_dump.format.reader import DumpReader, find_dump_files

from capture_utils import FIXTURES, py, run_cli, run_plain
from serving_model import generate, tiny
from tiny_models import build

pytestmark = [pytest.mark.integration, pytest.mark.capture]


def _fullgraph_compiles() -> None:
    """Skip where the model cannot be compiled with fullgraph=True without capture (transformers
    4's ModelOutput on torch 2.1's dynamo): the program fails by itself there."""
    model = build("llama")
    try:
        with torch.no_grad():
            torch.compile(model, backend="eager", fullgraph=True)(PROMPTS[0])
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"a fullgraph compile of the model fails without capture: "
                    f"{type(exc).__name__}")
    finally:
        torch._dynamo.reset()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test as in a fresh process, and no compiled state left for the tests after."""
    def reset():
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled._state["compiled_out"] = False

    reset()
    yield
    reset()


PROMPTS = [torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(n))
           for n in (9, 13)]


def _generate(model):
    with torch.no_grad():
        return [model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)[0]
                .tolist() for ids in PROMPTS]


def _config(path, **kw):
    return DumpConfig(dump_path=str(path), progress=False, **kw)


def _clean_blocks(path):
    with DumpReader(path) as r:
        return [r.read(rec) for rec in r.records[(r.records["kind"] == 0)]]


@pytest.mark.parametrize("how, backend", [("forward", "eager"), ("inplace", "aot_eager")])
def test_compiled_model_is_captured_like_the_eager_one(tmp_path, how, backend):
    model = build("llama")
    with register_hook(model, _config(tmp_path / "eager")) as eager:
        plain = _generate(model)
    with register_hook(model, _config(tmp_path / "compiled")) as session:
        if how == "forward":
            model.forward = torch.compile(model.forward, backend=backend)
        else:
            model.compile(backend=backend)
        tokens = _generate(model)
    assert tokens == plain and session.error is None and session.silence is None
    assert compiled.frames_compiled() > 0
    want, got = _clean_blocks(eager.path), _clean_blocks(session.path)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    with DumpReader(session.path) as r:
        assert r.status["sites_never_run"] == 0
        assert set(r.records["kind"]) >= {1, 2, 3, 4, 7}  # gain, dc, repeat, replay, causal
    result = compare_path(str(tmp_path / "compiled"), progress=False)
    assert FAULT not in set(result.layers["verdict"])


def test_inductor_compiled_module_is_captured_without_false_probes(tmp_path):
    """bf16 under inductor: the fused kernels round differently from the eager replays, so
    the probes would call every layer unstable; they are left out, and said."""
    model = build("llama", layers=6, dtype=torch.bfloat16)
    with torch.no_grad():
        want = [model(ids).logits for ids in PROMPTS]
    with register_hook(model, _config(tmp_path)) as session:
        cm = torch.compile(model)  # inductor, the default
        with torch.no_grad():
            got = [cm(ids).logits for ids in PROMPTS]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
    assert session.replays.compiled_dropped > 0
    with DumpReader(session.path) as r:
        assert len(r.rounds) == 2 and set(r.records["layer"]) == {-1, 0, 1, 2, 3, 4, 5}
        assert r.status["compiled_probes_dropped"] == session.replays.compiled_dropped
    result = compare_path(str(tmp_path), progress=False)
    assert FAULT not in set(result.layers["verdict"]), result.layers[["layer", "evidence"]]
    assert any("torch.compile'd code that an eager replay" in n for n in result.notes)


def test_a_planted_fault_in_a_compiled_model_is_named(tmp_path):
    model = build("llama", layers=6)
    with register_hook(model, _config(tmp_path, inject=["noise@layer=2,m=0.05,site=mlp"])):
        model.forward = torch.compile(model.forward, backend="eager")
        _generate(model)
    top = compare_path(str(tmp_path), progress=False).layers.iloc[0]
    assert (top["layer"], top["verdict"]) == (2, FAULT)


def test_hooks_registered_after_the_compiled_call_say_nothing_was_captured(tmp_path, capfd):
    model = build("llama")
    model.forward = torch.compile(model.forward, backend="eager")
    plain = _generate(model)
    with register_hook(model, _config(tmp_path)) as session:
        assert _generate(model) == plain
    from torch._dynamo.symbolic_convert import InstructionTranslator

    if session.path is not None:
        # torch 2.1 may recompile for the new shapes of later calls, tracing the hooks in
        assert not hasattr(InstructionTranslator, "current_tx")
        assert len(_clean_blocks(session.path)) > 0
        return
    assert find_dump_files(str(tmp_path)) == []
    assert "torch.compile'd code" in session.silence and "before" in session.silence
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"srdd-dump: warning: nothing captured: {session.silence}"]


@pytest.mark.parametrize("how", ["module", "forward"])
def test_a_fullgraph_compile_runs_and_its_hooks_are_compiled_out(tmp_path, how):
    _fullgraph_compiles()
    model = build("llama")
    with torch.no_grad():
        want = [model(ids).logits for ids in PROMPTS]
    with register_hook(model, _config(tmp_path)) as session:
        if how == "module":
            run = torch.compile(model, backend="eager", fullgraph=True)
        else:
            model.forward = run = torch.compile(model.forward, backend="eager", fullgraph=True)
        with torch.no_grad():
            got = [run(ids).logits for ids in PROMPTS]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert session.path is None and "fullgraph=True" in session.silence


def test_a_fullgraph_function_around_the_model_runs_and_says_so(tmp_path):
    """The model called inside a fullgraph-compiled function: the hooks are compiled out
    (on torch 2.1 the hooks, bound methods then, failed the user's compile)."""
    model = build("llama")
    with torch.no_grad():
        want = [model(ids).logits for ids in PROMPTS]
    with register_hook(model, _config(tmp_path)) as session:
        run = torch.compile(lambda ids: model(ids).logits, backend="eager", fullgraph=True)
        with torch.no_grad():
            got = [run(ids) for ids in PROMPTS]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert session.path is None and "fullgraph=True" in session.silence


def test_sites_compiled_before_the_hooks_are_counted_and_said(tmp_path, capfd):
    """The serving fixture's attention breaks the graph (``int(positions.max())``): compiled
    before the hooks, the blocks' compiled pieces (their norms, before and after the attention,
    and their MLPs) never run a hook."""
    model = torch.compile(tiny(layers=3), backend="eager")
    prompt = PROMPTS[0][0].tolist()
    plain = generate(model, [prompt], 4)
    with register_hook(model, _config(tmp_path)) as session:
        assert generate(model, [prompt], 4) == plain
    with DumpReader(session.path) as r:
        assert r.status["sites_never_run"] == 9  # 3 x (input norm, post-attention norm, MLP)
    assert "the hooks of 9 of 15 capture sites never ran (_orig_mod.model.layers.0.mlp" \
        in capfd.readouterr().err
    result = compare_path(str(tmp_path), progress=False)
    assert any("9 blocks or sub-layers never ran" in n for n in result.notes)


def test_compiled_parts_names_every_way_of_compiling():
    model = build("llama", layers=2)
    assert compiled.compiled_parts(model) == []
    assert compiled.compiled_parts(torch.compile(model)) == ["OptimizedModule (torch.compile)"]
    model.model.layers[1].forward = torch.compile(model.model.layers[1].forward)
    model.model.layers[0].compile()
    assert compiled.compiled_parts(model) == ["model.layers.0 (.compile())",
                                              "model.layers.1.forward (torch.compile)"]


# -- srdd-dump --exec on unmodified compiled scripts ------------------------------------------


def _plain(tmp_path, *args):
    out = tmp_path / "plain.json"
    run_plain([sys.executable, os.path.join(FIXTURES, "infer_compiled.py"), *args,
               "--out", str(out)])
    return json.loads(out.read_text())


def test_exec_captures_a_compiled_script(tmp_path):
    plain = _plain(tmp_path, "--how", "forward")
    out = tmp_path / "captured.json"
    res = run_cli("srdd-dump", "--exec", py("infer_compiled.py", "--how", "forward", "--out",
                                            str(out)), "-o", str(tmp_path / "d"))
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text()) == plain
    (path,) = find_dump_files(str(tmp_path / "d"))
    with DumpReader(path) as r:
        assert r.n_samples == 3 and r.status["sites_never_run"] == 0


def test_exec_on_a_fullgraph_script_says_so_and_eager_captures_it(tmp_path):
    _fullgraph_compiles()
    plain = _plain(tmp_path, "--fullgraph")
    out = tmp_path / "captured.json"
    cmd = py("infer_compiled.py", "--fullgraph", "--out", str(out))
    res = run_cli("srdd-dump", "--exec", cmd, "-o", str(tmp_path / "d"))
    assert res.returncode == 3 and json.loads(out.read_text()) == plain
    lines = [line for line in res.stderr.splitlines() if line.startswith("srdd-dump")]
    assert len(lines) == 1 and "nothing captured" in lines[0] and "fullgraph=True" in lines[0]
    assert "--eager" in lines[0]
    res = run_cli("srdd-dump", "--exec", cmd, "-o", str(tmp_path / "e"), "--eager")
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text()) == plain
    (path,) = find_dump_files(str(tmp_path / "e"))
    with DumpReader(path) as r:
        assert r.n_samples == 3


def test_exec_when_every_forward_is_inside_a_fullgraph_function(tmp_path):
    script = tmp_path / "fn.py"
    script.write_text(
        f"import sys; sys.path.insert(0, {FIXTURES!r})\n"
        "import torch\nfrom tiny_models import build\nmodel = build('llama')\n"
        "f = torch.compile(lambda ids: model(ids).logits, backend='eager', fullgraph=True)\n"
        "with torch.no_grad():\n    f(torch.randint(0, 128, (1, 7)))\nprint('done')\n")
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"))
    assert res.returncode == 3 and "done" in res.stdout
    lines = [line for line in res.stderr.splitlines() if line.startswith("srdd-dump")]
    assert lines == ["srdd-dump: error: no model forward was seen: the models run inside "
                     "fullgraph=True torch.compile'd code, where srdd-dump's hooks cannot run; "
                     "run eagerly: srdd-dump --eager"]


def test_exec_when_a_fullgraph_process_is_killed_before_it_reports(tmp_path):
    """A serving engine's worker compiles the model fullgraph and is killed at shutdown
    (vLLM SIGKILLs it): the compiled-out hooks are said all the same, not 'no model ran'."""
    _fullgraph_compiles()
    script = tmp_path / "killed.py"
    script.write_text(
        f"import os, signal, sys; sys.path.insert(0, {FIXTURES!r})\n"
        "import torch\nfrom tiny_models import build\nmodel = build('llama')\n"
        "run = torch.compile(model, backend='eager', fullgraph=True)\n"
        "with torch.no_grad():\n    run(torch.randint(0, 128, (1, 7)))\n"
        "print('served', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"))
    assert res.returncode != 0 and "served" in res.stdout
    lines = [line for line in res.stderr.splitlines() if line.startswith("srdd-dump")]
    assert any("fullgraph=True" in line and "--eager" in line for line in lines), lines
    assert not any("no model" in line for line in lines), lines
