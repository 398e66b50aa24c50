"""Mixture of experts: the router, the fused experts and one site per expert are captured,
a faulty expert is named as (layer, expert), routing flips under a probe are never a fault,
and both stores give the same expert signals."""

from __future__ import annotations

import glob

import numpy as np
import pandas as pd
import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.analysis.experts import expert_rows as expert_rows_np
from srdd_dump.analysis.experts import split_route
from srdd_dump.capture.discovery import find_blocks, find_moe_sites
from srdd_dump.capture.experts import (
    expert_rows,
    pinned_routing,
    routing_of,
    slot_outputs,
    topk_margin,
)
from srdd_dump.capture.faults import install_faults
from srdd_dump.capture.faultspec import parse_fault
from srdd_dump.compare import compare_path
from srdd_dump.errors import UserError
from srdd_dump.format import schema
from srdd_dump.format.reader import DumpReader

from capture_utils import FIXTURES, run_cli
from moe_models import ARCHS, build, experts_modules

pytestmark = pytest.mark.integration


def _prompts(n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (1, length), generator=gen) for length in (9, 14, 19)[:n]]


def _generate(model, prompts):
    with torch.no_grad():
        return [model.generate(p, max_new_tokens=4, do_sample=False, pad_token_id=0)
                for p in prompts]


def _capture(model, path, inject=(), store="sample:32768", prompts=None):
    config = DumpConfig(dump_path=str(path), samples=3, inject=list(inject), store=store,
                        progress=False)
    with register_hook(model, config) as session:
        tokens = _generate(model, prompts or _prompts())
    return session, tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_sites_of_every_moe_layer(arch):
    model = build(arch, layers=2)
    sites = find_moe_sites(find_blocks(model))
    for layer in range(2):
        mine = {(s.role, s.name) for s in sites if s.layer == layer}
        prefix = f"model.layers.{layer}.mlp"
        assert ("router", f"{prefix}.gate") in mine
        assert ("experts", f"{prefix}.experts") in mine
        assert ("expert_slots", f"{prefix}.experts.slots") in mine
        assert {n for r, n in mine if r == "expert"} == {f"{prefix}.experts.{e}"
                                                         for e in range(4)}


def test_expert_parallel_experts_are_captured_as_their_sum():
    """A rank holding 2 of the router's 4 experts (transformers' expert parallelism sets the
    module's num_experts to its own count): router and sum only, no call of the experts."""
    model = build("mixtral", layers=2)
    for module in experts_modules(model).values():
        module.num_experts = 2
    roles = {s.role for s in find_moe_sites(find_blocks(model))}
    assert roles == {"router", "experts"}


def test_experts_called_by_parameter_name():
    class Swapped(torch.nn.Module):  # (hidden, weights, indices): another engine's order
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 4, 4))

        def forward(self, x, routing_weights, expert_indices):
            out = torch.zeros_like(x)
            for j in range(expert_indices.shape[1]):
                w = self.w[expert_indices[:, j]]
                out += routing_weights[:, j:j + 1] * torch.einsum("th,toh->to", x, w)
            return out

    experts = Swapped()
    x = torch.randn(5, 4)
    index = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    weights = torch.rand(5, 2)
    slots = slot_outputs(experts, x, index).reshape(5, 2, 4)
    assert torch.allclose((slots * weights.unsqueeze(-1)).sum(1), experts(x, weights, index),
                          atol=1e-6)


def test_slot_outputs_are_each_experts_own_output():
    model = build("mixtral", layers=2)
    experts = experts_modules(model)["model.layers.0.mlp.experts"]
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    _, weights, index = model.model.layers[0].mlp.gate(x)
    with torch.no_grad():
        slots = slot_outputs(experts, x, index)
        summed = experts(x, index, weights)
        # the model's sum is the weighted sum of the slots
        k = index.shape[1]
        again = (slots.reshape(6, k, 64) * weights.unsqueeze(-1)).sum(dim=1)
        assert torch.allclose(summed, again, atol=1e-6)
        for e in range(4):
            rows, routed = expert_rows(slots, index, e)
            one = torch.full((int(routed.sum()), 1), e)
            alone = experts(x[routed], one, torch.ones(one.shape))
            assert torch.equal(rows[routed], alone)
            assert not rows[~routed].any()
            np_rows, np_routed = expert_rows_np(slots.numpy(), index.numpy(), e)
            assert np.array_equal(np_rows, rows.numpy()) and np.array_equal(np_routed,
                                                                             routed.numpy())


def test_routing_is_pinned_in_replays():
    model = build("mixtral", layers=2)
    experts = experts_modules(model)["model.layers.0.mlp.experts"]
    moe = model.model.layers[0].mlp
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(2))
    seen = []
    handle = experts.register_forward_hook(
        lambda m, a, k, o: seen.append(routing_of(a, k)[1]), with_kwargs=True)
    with torch.no_grad():
        moe(x)
        recorded = seen[-1]
        far = x + 50 * torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
        moe(far)
        assert not torch.equal(seen[-1].index, recorded.index)  # the probe would flip routing
        with pinned_routing([experts], {id(experts): recorded}):
            moe(torch.cat([x, far]))  # two copies, as a batched replay stacks them
    handle.remove()
    assert torch.equal(seen[-1].index, recorded.index.repeat(2, 1))
    assert torch.equal(seen[-1].weights, recorded.weights.repeat(2, 1))


def test_expert_fault_changes_only_its_tokens():
    model = build("qwen2_moe", layers=2)
    blocks = find_blocks(model)
    experts = experts_modules(model)["model.layers.1.mlp.experts"]
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    _, weights, index = model.model.layers[1].mlp.gate(x)
    with torch.no_grad():
        clean = experts(x, index, weights)
        handles, described = install_faults(
            model, blocks, [parse_fault("dead_zone@layer=1,site=expert:2,m=0.5")])
        bad = experts(x, index, weights)
    for h in handles:
        h.remove()
    routed = (index == 2).any(dim=1)
    assert described[0]["module"] == "model.layers.1.mlp.experts"
    assert torch.equal(bad[~routed], clean[~routed])
    assert not torch.equal(bad[routed], clean[routed])
    with pytest.raises(UserError, match="expert must be 0..3"):
        install_faults(model, blocks, [parse_fault("noise@layer=1,site=expert:9")])


def test_router_fault_changes_the_routing():
    model = build("mixtral", layers=2)
    blocks = find_blocks(model)
    gate = model.model.layers[0].mlp.gate
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(5))
    _, w0, i0 = gate(x)
    handles, _ = install_faults(model, blocks, [parse_fault("noise@layer=0,site=router,m=2")])
    _, w1, i1 = gate(x)
    for h in handles:
        h.remove()
    assert not torch.equal(i0, i1)
    assert torch.allclose(w1.sum(dim=-1), torch.ones(16))  # Mixtral's weights stay normalised


def test_router_statistics():
    index = np.array([[0, 1], [1, 2], [1, 9]])  # 9: out of range, never read
    routed = [int(expert_rows_np(np.zeros((3, 2 * 4)), index, e)[1].sum()) for e in range(4)]
    assert routed == [1, 3, 1, 0]
    route = np.concatenate([index, np.full((3, 2), 0.5), np.full((3, 1), 0.2)], axis=1)
    got_index, weights, margin = split_route(route[None])
    assert np.array_equal(got_index, index) and weights.shape == (3, 2)
    assert np.allclose(margin, 0.2)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.4, 0.2]]))
    assert torch.allclose(topk_margin(logits, torch.tensor([[0], [1]])),
                          torch.tensor([0.2, 0.0]))
    # a router that chose by another score (DeepSeek's bias): negative
    assert torch.allclose(topk_margin(logits, torch.tensor([[2], [2]])),
                          torch.tensor([-0.3, -0.2]))


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_is_transparent_and_healthy_runs_clean(tmp_path, arch):
    model = build(arch)
    want = _generate(model, _prompts())
    session, got = _capture(model, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert session.error is None and session.site_errors == 0
    result = compare_path(str(tmp_path))
    assert (result.layers["verdict"] != "FAULT").all(), result.headlines
    experts = result.sites[result.sites["role"] == "expert"]
    assert set(experts["expert"].dropna().astype(int)) == {0, 1, 2, 3}
    # the margin is negative where the router ranks by another score (DeepSeek's groups)
    assert (experts["tokens"] > 0).all() and np.isfinite(experts["topk_margin"]).all()


@pytest.mark.parametrize("case,label,store", [
    ("dead_zone@layer=2,site=expert:1,quantile=0.05", "DEAD_ZONE", "sample:32768"),
    ("saturation@layer=2,site=expert:3,quantile=0.95", "SAT", "sample:32768"),
    # a clamp of a tenth of the channels: other channels' values pass the limit, so what it
    # clips sits at its channel's extreme, not its row's
    ("saturation@layer=2,site=expert:3,quantile=0.8,sparsity=0.1", "SAT_SOURCE", "sample:32768"),
    ("saturation@layer=2,site=expert:3,quantile=0.8,sparsity=0.1", "SAT_SOURCE", "stats"),
    ("noise@layer=1,site=expert:0,m=0.1,sparsity=0.1", "NOISE_SOURCE", "sample:32768"),
    ("bias@layer=3,site=expert:2,quantile=0.5", "BIAS", "sample:32768"),
    ("precision@layer=1,site=expert:2", "PRECISION", "sample:32768"),
    ("dead_zone@layer=2,site=expert:1,quantile=0.05", "DEAD_ZONE", "stats"),
    ("bias@layer=3,site=expert:2,quantile=0.5,sparsity=0.1", "BIAS", "stats"),
])
def test_faulty_expert_is_named(tmp_path, case, label, store):
    model = build("mixtral")
    _capture(model, tmp_path, [case], store=store)
    result = compare_path(str(tmp_path))
    top = result.layers.iloc[0]
    spec = parse_fault(case)
    assert (int(top["layer"]), top["verdict"]) == (spec.layer, "FAULT"), result.headlines
    assert int(top["expert"]) == int(spec.site.split(":")[1])
    assert top["site"] == f"model.layers.{spec.layer}.mlp.experts.{int(top['expert'])}"
    assert label in top["diagnosis"]


def test_router_fault_is_named(tmp_path):
    model = build("qwen2_moe")
    _capture(model, tmp_path, ["noise@layer=2,site=router,m=0.3"])
    top = compare_path(str(tmp_path)).layers.iloc[0]
    assert (int(top["layer"]), top["verdict"], top["site"]) == (2, "FAULT",
                                                                "model.layers.2.mlp.gate")


def test_both_stores_give_the_same_expert_signals(tmp_path):
    model = build("deepseek_v3")
    signals = {}
    for store in ("full", "stats"):
        _capture(model, tmp_path / store, store=store)
        sites = compare_path(str(tmp_path / store)).sites
        signals[store] = sites[sites["role"] == "expert"].set_index(["module", "phase"])
    full, stats = signals["full"], signals["stats"].loc[signals["full"].index]
    for column in ("kurtosis", "zero_frac", "gain", "instability", "tokens", "topk_margin",
                   "lowbits"):
        assert np.allclose(full[column], stats[column], rtol=1e-6, equal_nan=True), column


def test_dump_records_routing(tmp_path):
    model = build("mixtral", layers=2)
    _capture(model, tmp_path, store="full")
    reader = DumpReader(glob.glob(str(tmp_path / "*.h5"))[0])
    sites = reader.meta["sites"]
    slots = sites.index("model.layers.1.mlp.experts.slots")
    recs = reader.records
    route = recs[(recs["site"] == slots) & (recs["kind"] == schema.KIND_ROUTE)]
    assert len(route) == len(reader.rounds)
    index, weights, margin = split_route(reader.read(route[0]))
    assert index.shape[1] == 2 and ((index >= 0) & (index < 4)).all()
    assert np.allclose(weights.sum(axis=1), 1, atol=1e-5)  # Mixtral normalises its top-k
    assert np.isfinite(margin).all()


def test_exec_left_padded_moe_batch_is_clean(tmp_path):
    """The padded prefill is the first model call, before capture had its own hook on the
    model: its attention mask must still be read."""
    out = tmp_path / "dumps"
    done = run_cli("srdd-dump", "--exec",
                   f"python {FIXTURES}/infer_moe.py --model mixtral --prompts 3 --padded left",
                   "-o", str(out))
    assert done.returncode == 0, done.stderr
    path = glob.glob(str(out / "*" / "*.h5"))[0]
    recs = DumpReader(path).records
    assert (recs["kind"] == schema.KIND_MASK).sum() >= 1
    report = tmp_path / "r.csv"
    run_cli("srdd-compare", str(out), "-o", str(report), "-q")
    assert (pd.read_csv(report)["verdict"] != "FAULT").all()
