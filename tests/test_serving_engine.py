"""Serving-engine blocks (vLLM / SGLang style): ``block(positions, hidden_states, residual) ->
(hidden_states, residual)`` with a fused, in-place add + norm. Capture records the stream they
represent (hidden + residual), and the probes perturb and read that stream
(fixtures/serving_model.py; srdd_dump/capture/serving.py)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.analysis.diagnosis import FAULT
from srdd_dump.capture import serving
from srdd_dump.compare import compare_baseline, compare_path
from srdd_dump.format import schema
from srdd_dump.format.reader import DumpReader, find_dump_files

from capture_utils import FIXTURES, py, run_cli, run_plain
from serving_model import RMSNorm, from_hf, generate, tiny
from tiny_models import build

pytestmark = [pytest.mark.integration, pytest.mark.capture]
LAYERS = 6


def _prompts(n=(24, 31)):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, 128, (k,), generator=gen).tolist() for k in n]


def _streams(model, run):
    """{-1: stack input, i: hidden + residual after block i} of one call, by plain hooks."""
    got = {}
    layers = model.model.layers
    handles = [layers[0].register_forward_pre_hook(
        lambda m, a: got.__setitem__(-1, a[1].clone()))]
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(
            lambda m, a, out, i=i: got.__setitem__(i, (out[0] + out[1]).clone())))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return got


def _capture(model, tmp_path, flat=False, new_tokens=10, **cfg):
    config = DumpConfig(dump_path=str(tmp_path), progress=False, **cfg)
    with register_hook(model, config) as session:
        tokens = [generate(model, [p], new_tokens, flat=flat)[0] for p in _prompts()]
    return session, tokens


# -- the fixture is the model it claims to be --------------------------------------------------


@pytest.mark.parametrize("weights", ["tiny", "smollm2"])
def test_fixture_stream_equals_the_hf_models_hidden_states(weights):
    if weights == "tiny":
        hf = build("llama", layers=LAYERS)
    else:
        from smollm2 import load

        hf = load()[0]
    model = from_hf(hf)
    ids = torch.randint(1, 128, (2, 19), generator=torch.Generator().manual_seed(0))
    hf_out = {}
    handles = [layer.register_forward_hook(
        lambda m, a, out, i=i: hf_out.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i, layer in enumerate(hf.model.layers)]
    with torch.no_grad():
        hf(ids)
        for h in handles:
            h.remove()
        batch = _streams(model, lambda: model(ids, torch.arange(19).expand(2, 19)))
        flat = _streams(model, lambda: model(ids[1], torch.arange(19)))
    for i, ref in hf_out.items():
        # float32 rounding of another operation order, grown through the layers: judged as
        # the baseline mode judges a layer, by the relative distance of the whole output
        # (torch 2.1's kernels differ from HF's element-wise by up to 6e-4 of an element, by
        # 7e-7 of the whole on SmolLM2; a wrong rotary or residual is off by O(1))
        for mine, want in ((batch[i], ref), (flat[i], ref[1])):
            assert float((mine - want).norm() / want.norm()) < 1e-5, i
    prompts = ids[:, :12].tolist()
    want = hf.generate(ids[:, :12], max_new_tokens=5, do_sample=False, pad_token_id=0,
                       eos_token_id=None)[:, 12:].tolist()
    assert generate(model, prompts, 5) == want
    assert generate(model, prompts, 5, flat=True) == want


def test_fused_norm_works_in_place_like_the_cuda_kernel():
    norm = RMSNorm(8, 1e-5)
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    total = x + r
    out, res = norm(x, r)
    assert out is x and res is r  # the block's input tensors are overwritten
    torch.testing.assert_close(res, total)


# -- the convention, found generically -----------------------------------------------------------


def test_convention_is_found_by_parameter_names():
    model = tiny(layers=2)
    block, attn = model.model.layers[0], model.model.layers[0].self_attn
    hf_block = build("llama", layers=2).model.layers[0]
    assert serving.is_serving_block(block) and not serving.is_serving_block(hf_block)
    assert serving.replays_alone(block) and serving.replays_alone(attn)
    assert not serving.replays_alone(hf_block)
    assert not serving.replays_alone(model.model.layers[0].mlp)
    pos, h, r = torch.arange(4), torch.randn(4, 64), torch.randn(4, 64)
    x, _ = serving.named_input(attn, (pos, h), {})
    assert x is h  # by name: positions come first
    assert serving.stream_output(block, (h, r)).equal(h + r)
    assert serving.stream_output(block, (h, r[:2])) is None
    assert serving.stream_output(hf_block, (h, r)) is None


def test_stream_perturbation_goes_into_residual_or_into_hidden_on_the_first_block():
    block = tiny(layers=2).model.layers[0]
    pos, h, r = torch.arange(4), torch.randn(4, 64), torch.randn(4, 64)
    x, rebuild = serving.stream_perturbation(block, (pos, h, r), {})
    assert x.equal(h + r)
    d = torch.randn(4, 64)
    (p, h2, r2), kw = rebuild(x + d)
    assert p is pos and h2 is h and kw == {}
    torch.testing.assert_close(h2 + r2, x + d)
    assert rebuild(x) == ((pos, h, r), {})  # the recorded call
    (p, h3, r3), _ = serving.frozen_call(block, (pos, h, r), {})  # copies, for in-place norms
    assert p is pos and h3.equal(h) and h3 is not h and r3.equal(r) and r3 is not r
    x, rebuild = serving.stream_perturbation(block, (pos,), {"hidden_states": h, "residual": None})
    assert x is h
    args, kw = rebuild(x + d)
    assert kw["residual"] is None and kw["hidden_states"].equal(x + d)


# -- capture -----------------------------------------------------------------------------------


@pytest.mark.parametrize("flat", [False, True], ids=["batch", "flat"])
def test_capture_records_the_stream_and_changes_nothing(tmp_path, flat):
    model = tiny(layers=LAYERS)
    prompt = _prompts()[0]
    plain_tokens = [generate(model, [p], 10, flat=flat)[0] for p in _prompts()]
    ids = torch.tensor(prompt if flat else [prompt])
    pos = torch.arange(len(prompt)).expand_as(ids)
    with torch.no_grad():
        expected = _streams(model, lambda: model(ids, pos))
    session, tokens = _capture(model, tmp_path, flat=flat)
    assert tokens == plain_tokens and session.error is None and session.site_errors == 0
    with DumpReader(session.path) as r:
        assert r.meta["block_class"] == "LlamaDecoderLayer"
        first = r.rounds[0]
        assert (int(first["seq"]), int(first["batch"])) == (len(prompt), 1)
        assert {int(x["step"]) for x in r.rounds} == {0, 1, 2, 7}
        np.testing.assert_array_equal(r.token_ids(first), prompt)
        for layer in range(-1, LAYERS):
            clean = r.select(layer)[0]
            np.testing.assert_array_equal(r.read(clean).reshape(len(prompt), -1),
                                          expected[layer].reshape(len(prompt), -1).numpy())
        for layer in range(LAYERS):
            recs = r.records[(r.records["layer"] == layer)
                             & (r.records["site"] == schema.BLOCK_SITE)
                             & (r.records["round"] == 0)]
            kinds = {schema.KIND_NAMES[int(k)] for k in recs["kind"]}
            assert {"clean", "replay", "gain", "dc", "repeat", "causal"} <= kinds
            clean = r.read(recs[recs["kind"] == schema.KIND_CLEAN][0]).reshape(-1, 64)
            for rec in recs[recs["kind"] == schema.KIND_REPEAT]:
                # replayed on the inputs as they were before the in-place fused norm
                np.testing.assert_array_equal(r.read(rec).reshape(-1, 64), clean)
            for rec in recs[(recs["kind"] == schema.KIND_GAIN) | (recs["kind"] == schema.KIND_DC)]:
                assert rec["pert_rms"] > 0
                assert not np.array_equal(r.read(rec).reshape(-1, 64), clean)
            (causal,) = recs[recs["kind"] == schema.KIND_CAUSAL]
            cut = int(causal["param"])
            got = r.read(causal).reshape(-1, 64)
            np.testing.assert_array_equal(got[:cut], clean[:cut])
            assert not np.array_equal(got[cut:], clean[cut:])


def test_probes_without_repeats_leave_the_kv_cache_as_the_call_wrote_it(tmp_path):
    """A probed block writes the KV cache at its positions; the last replay is unperturbed, so
    the cache holds what the recorded call wrote."""
    model = tiny(layers=3)
    ids, pos = torch.tensor(_prompts()[0]), torch.arange(24)

    def run():
        model.bind_kv_cache(1, 32)
        with torch.no_grad():
            hidden = model(ids, pos)
        return hidden, [layer.self_attn.attn.kv_cache.clone() for layer in model.model.layers]

    plain, plain_caches = run()
    with register_hook(model, DumpConfig(dump_path=str(tmp_path), probes="gain,dc",
                                         progress=False)) as session:
        captured, caches = run()
    assert session.replays.sequential > 0 and session.replays.batched > 0  # the mlp batches
    assert captured.equal(plain)
    assert all(a.equal(b) for a, b in zip(caches, plain_caches))


def test_serving_dump_equals_the_hf_dump_of_the_same_weights(tmp_path):
    hf = build("llama", layers=LAYERS)
    with register_hook(hf, DumpConfig(dump_path=str(tmp_path / "hf"), progress=False)):
        for p in _prompts():
            hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    _capture(from_hf(hf), tmp_path / "serving")
    result = compare_baseline(str(tmp_path / "serving"), str(tmp_path / "hf"), progress=False)
    table = result.table
    assert len(table) == 2 * 4 * (LAYERS + 1)  # 2 samples x 4 steps x (stack input + blocks)
    assert table["input_match"].all() and (table["verdict"] == "PASS").all()
    assert table["max_absolute_error"].max() <= 1e-5


@pytest.mark.parametrize("flat, cfg", [(False, {}), (True, {}),
                                       (False, {"granularity": "op", "reference": "host"})],
                         ids=["batch", "flat", "op-host"])
def test_healthy_serving_model_has_no_fault(tmp_path, flat, cfg):
    session, _ = _capture(tiny(layers=LAYERS), tmp_path, flat=flat, **cfg)
    assert session.site_errors == 0 and session.records_dropped == 0
    result = compare_path(str(tmp_path), progress=False)
    assert len(result.layers) == LAYERS
    assert FAULT not in set(result.layers["verdict"]), result.layers[["layer", "evidence"]]
    if cfg:  # the fused add + norms are probed on their inputs as they were before the call
        with DumpReader(session.path) as r:
            # the engine's gated activation (vLLM's SiluAndMul) is an operator too
            assert "model.layers.2.mlp.act_fn" in r.sites
            norm = r.sites.index("model.layers.2.post_attention_layernorm")
            recs = r.records[(r.records["site"] == norm) & (r.records["round"] == 0)]
            clean = r.read(recs[recs["kind"] == schema.KIND_CLEAN][0]).reshape(-1, 64)
            (repeat, *_) = recs[recs["kind"] == schema.KIND_REPEAT]
            np.testing.assert_array_equal(r.read(repeat).reshape(-1, 64), clean)


@pytest.mark.parametrize("spec", ["noise@layer=2,site=mlp", "dead_zone@layer=3,m=0.3,sparsity=0.1",
                                  "noise@layer=4,m=0.05,site=attn"])
def test_planted_fault_is_named(tmp_path, spec):
    _capture(tiny(layers=LAYERS), tmp_path, inject=[spec])
    result = compare_path(str(tmp_path), progress=False)
    layer = int(spec.split("layer=")[1].split(",")[0])
    top = result.layers.iloc[0]
    assert (top["layer"], top["verdict"]) == (layer, FAULT), result.layers.head()
    assert (result.layers["verdict"] == FAULT).sum() == 1


def test_a_dead_zone_in_the_engines_gated_activation_is_named_by_the_operator_hunt(tmp_path):
    """A fused SwiGLU kernel (vLLM's SiluAndMul) that flushes small products to zero in one
    layer: the hunt's operators hold the activation, and its host replay names it."""
    model = tiny(layers=LAYERS)
    act = model.model.layers[2].mlp.act_fn
    plain = act.forward

    def flushed(x):
        y = plain(x)
        return torch.where(y.abs() < 0.02 * y.abs().amax(), torch.zeros_like(y), y)

    act.forward = flushed
    _capture(model, tmp_path, granularity="op", reference="host", layers="model.layers.2")
    result = compare_path(str(tmp_path), progress=False)
    top = result.layers.iloc[0]
    assert (top["layer"], top["verdict"]) == (2, FAULT), result.layers.head()
    assert "act_fn" in result.headlines[0], result.headlines


def test_a_flush_in_the_engines_gated_activation_is_found_at_default_options(tmp_path):
    """The same flushing SiluAndMul, default options: the reference MLP of a fused
    gate_up_proj (vLLM's layout: the gate half first) finds it at the MLP; healthy MLPs of
    that layout pass (test_healthy_serving_model_has_no_fault)."""
    model = tiny(layers=LAYERS)
    act = model.model.layers[2].mlp.act_fn
    plain = act.forward
    act.forward = lambda x: torch.where(plain(x).abs() < 0.02, torch.zeros(()), plain(x))
    session, _ = _capture(model, tmp_path)
    assert not any("MLP references" in line for line in session.coverage.shortfalls())
    result = compare_path(str(tmp_path), progress=False)
    top = result.layers.iloc[0]
    assert (top["layer"], top["verdict"]) == (2, FAULT), result.layers.head()
    assert top["diagnosis"].split(",")[0] == "MLP_MISMATCH", top["diagnosis"]


def test_fault_on_a_serving_block_acts_on_the_stream():
    model = tiny(layers=3)
    ids, pos = torch.tensor(_prompts()[0]), torch.arange(24)
    with torch.no_grad():
        clean = _streams(model, lambda: model(ids, pos))
    with register_hook(model, DumpConfig(dump_path="unused", inject=["dead_zone@layer=1,m=0.3"],
                                         probes="none", samples=1, progress=False)) as s:
        s.remove()  # the fault alone
        with torch.no_grad():
            faulty = _streams(model, lambda: model(ids, pos))
    amax = clean[1].abs().max()
    want = torch.where(clean[1].abs() < 0.3 * amax, torch.zeros_like(clean[1]), clean[1])
    torch.testing.assert_close(faulty[1], want)


def test_exec_on_an_unmodified_serving_script(tmp_path):
    plain, captured = tmp_path / "plain.json", tmp_path / "captured.json"
    script = ["--model", "tiny", "--flat", "--out"]
    run_plain([sys.executable, os.path.join(FIXTURES, "infer_serving.py"), *script, str(plain)])
    res = run_cli("srdd-dump", "--exec", py("infer_serving.py", *script, str(captured)),
                  "-o", str(tmp_path / "ok"))
    assert res.returncode == 0, res.stderr
    assert json.loads(plain.read_text()) == json.loads(captured.read_text())
    (path,) = find_dump_files(str(tmp_path / "ok"))
    with DumpReader(path) as r:
        assert r.n_samples == 4 and r.meta["block_class"] == "LlamaDecoderLayer"
    res = run_cli("srdd-compare", str(tmp_path / "ok"), "--fail-on", "fault", "-o",
                  str(tmp_path / "ok.csv"))
    assert res.returncode == 0, res.stdout + res.stderr

    res = run_cli("srdd-dump", "--exec", py("infer_serving.py", *script, str(captured)),
                  "-o", str(tmp_path / "bad"), "--inject", "noise@layer=2,site=mlp")
    assert res.returncode == 0, res.stderr
    res = run_cli("srdd-compare", str(tmp_path / "bad"), "--fail-on", "fault", "-o",
                  str(tmp_path / "bad.csv"))
    assert res.returncode == 1 and "Layer 2 (model.layers.2" in res.stdout, res.stdout


def test_an_in_place_rotary_is_replayed_on_copies_and_changes_nothing(tmp_path):
    # the fixture's rotary embedding rotates query and key in place, as vLLM's kernels do: at
    # --granularity op its replays must not rotate the engine's query and key a second time
    model = tiny(layers=LAYERS)
    rotary = model.model.layers[0].self_attn.rotary_emb
    assert serving.rotates_in_place(rotary) and serving.overwrites_inputs(rotary)
    pos, q, k = torch.arange(3), torch.randn(3, 64), torch.randn(3, 32)
    (p2, q2, k2), _ = serving.frozen_call(rotary, (pos, q, k), {})
    assert p2 is pos and q2.equal(q) and q2 is not q and k2 is not k
    plain = [generate(model, [p], 10)[0] for p in _prompts()]
    session, tokens = _capture(model, tmp_path, granularity="op")
    assert tokens == plain and session.error is None and session.site_errors == 0
    with DumpReader(session.path) as r:
        # every layer holds the one rotary embedding (vLLM's get_rope): one site, of layer 0,
        # recorded once per round (its first call), not once per layer
        assert [s for s in r.sites if s.endswith("rotary_emb")] == [
            "model.layers.0.self_attn.rotary_emb"]
        site = list(r.sites).index("model.layers.0.self_attn.rotary_emb")
        recs = r.records[(r.records["site"] == site) & (r.records["round"] == 0)]
        assert (recs["kind"] == schema.KIND_CLEAN).sum() == 1
        clean = r.read(recs[recs["kind"] == schema.KIND_CLEAN][0])
        repeats = recs[recs["kind"] == schema.KIND_REPEAT]
        assert len(repeats)
        for rec in repeats:  # replayed on the query as it was before the call rotated it
            np.testing.assert_array_equal(r.read(rec), clean)


def test_a_fused_add_norm_is_perturbed_on_the_stream_it_normalises():
    """norm(x, residual) normalises x + residual. A row whose residual holds a massive value
    (the first token's) barely moves when x alone is perturbed by x's own spread: the dc
    probe must shift the stream by the stream's spread, through the residual, x as recorded
    (a healthy vLLM run read such a row as clipped: FAULT at a layer's input_layernorm)."""
    from srdd_dump.capture.probes import ProbeSpec, run_probes
    from srdd_dump.format import schema

    from serving_model import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(3, 16) * 0.01
    residual = torch.randn(3, 16)
    residual[0, 5] = 1000.0  # a massive activation
    stream = x + residual
    recorded = norm._norm(stream)
    spec = ProbeSpec(sigmas=(0.1,), draws=1, dc=(1.0,), repeats=1, batched=True)
    outputs, _ = run_probes(norm, (x.clone(),), {"residual": residual.clone()}, recorded, spec,
                            lambda kind, probe: 7, fused_add=True)
    by_kind = {p.kind: p for p in outputs}
    dc = by_kind[schema.KIND_DC]
    std = stream.std(dim=-1, unbiased=False, keepdim=True)
    torch.testing.assert_close(dc.perturbation, std.expand_as(stream), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_kind[schema.KIND_REPEAT].output, recorded, rtol=0, atol=0)
    # the massive row's outputs move under the dc shift (they did not with x alone perturbed)
    assert (dc.output[0] != recorded[0]).float().mean() > 0.9
