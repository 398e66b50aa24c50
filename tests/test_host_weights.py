"""The references' float64 weights: cached within a budget, beyond it converted into one reused
buffer; either way the references are the same, bit for bit."""

from __future__ import annotations

import glob

import numpy as np
import pytest
import torch
from torch import nn

from srdd_dump import DumpConfig, register_hook
from srdd_dump.capture import host_weights
from srdd_dump.capture.host_weights import HostWeights
from srdd_dump.format import schema
from srdd_dump.format.reader import DumpReader

from tiny_models import build

pytestmark = pytest.mark.capture


def _linears(dtype: torch.dtype) -> list[nn.Linear]:
    torch.manual_seed(0)
    # two of one shape (k and v of a layer), a larger one, one with a bias
    return [nn.Linear(16, 8, bias=False).to(dtype), nn.Linear(16, 8, bias=False).to(dtype),
            nn.Linear(16, 40, bias=False).to(dtype), nn.Linear(40, 16).to(dtype)]


def _exact(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w = module.weight.detach().double()
    return x @ w.T + (0 if module.bias is None else module.bias.detach().double())


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weights_over_the_budget_give_the_cached_results(dtype):
    modules = _linears(dtype)
    x = {16: torch.randn(5, 16, dtype=torch.float64), 40: torch.randn(5, 40, dtype=torch.float64)}
    cached, converted = HostWeights(), HostWeights(budget=0)
    held = []
    for _ in range(2):  # twice: the second pass reads the cache / reuses the buffer
        for m in modules:
            a = cached.linear(m, x[m.in_features])
            b = converted.linear(m, x[m.in_features])
            assert torch.equal(a, b) and torch.equal(a, _exact(m, x[m.in_features]))
            held.append((m, b))
    assert converted.used == 0 and cached.used > 0
    # a result is its own tensor: later conversions into the buffer leave it as it was
    for m, b in held:
        assert torch.equal(b, _exact(m, x[m.in_features]))


def _host_records(folder) -> dict:
    (path,) = glob.glob(f"{folder}/**/*.h5", recursive=True)
    out = {}
    with DumpReader(path) as rd:
        for rec in rd.records:
            if rec["kind"] == schema.KIND_HOST:
                key = (int(rec["round"]), int(rec["layer"]), int(rec["site"]), int(rec["probe"]))
                out[key] = rd.read(rec).tobytes()
    return out


@pytest.mark.integration
def test_the_references_are_the_same_when_no_weight_is_cached(tmp_path, monkeypatch):
    ids = torch.tensor([[5, 17, 33, 2, 91, 40, 7, 66, 12, 3, 54, 8]])

    def dump(folder):
        model = build("llama", layers=3, dtype=torch.bfloat16)
        with register_hook(model, DumpConfig(dump_path=str(folder), samples=1)), \
                torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        return _host_records(folder)

    cached = dump(tmp_path / "cached")
    monkeypatch.setattr(host_weights, "BUDGET_BYTES", 0)
    converted = dump(tmp_path / "converted")
    assert len(cached) >= 2 * 3 * 2  # attention and MLP references of 3 layers, 2 rounds
    assert cached.keys() == converted.keys()
    assert all(np.array_equal(cached[k], converted[k]) for k in cached)


@pytest.mark.unit
def test_kept_weights_follow_a_change_of_the_model():
    """A training step (an in-place update), loaded weights or a new parameter between two
    samples: the reference uses the weights as they are, not the copy kept earlier."""
    layer = nn.Linear(16, 8)
    weights = HostWeights()
    x = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(weights.linear(layer, x), _exact(layer, x), rtol=0, atol=0)
    with torch.no_grad():
        layer.weight.add_(0.5)  # an optimizer step
        layer.bias.mul_(2)
    torch.testing.assert_close(weights.linear(layer, x), _exact(layer, x), rtol=0, atol=0)
    layer.load_state_dict({"weight": torch.randn(8, 16), "bias": torch.randn(8)})
    torch.testing.assert_close(weights.linear(layer, x), _exact(layer, x), rtol=0, atol=0)
    layer.weight = nn.Parameter(torch.randn(8, 16))
    torch.testing.assert_close(weights.linear(layer, x), _exact(layer, x), rtol=0, atol=0)
    layer.weight.data.copy_(torch.randn(8, 16))  # through .data: no version counter moves
    torch.testing.assert_close(weights.linear(layer, x), _exact(layer, x), rtol=0, atol=0)
    layer.weight.data = torch.randn(8, 16)
    torch.testing.assert_close(weights.linear(layer, x), _exact(layer, x), rtol=0, atol=0)
    assert weights.used == layer.weight.numel() * 8  # one conversion kept, not six
    bf16 = nn.Linear(16, 8).to(torch.bfloat16)  # a weight numpy has no dtype for
    torch.testing.assert_close(weights.linear(bf16, x), _exact(bf16, x), rtol=0, atol=0)


def test_a_training_step_between_samples_is_no_reference_mismatch(tmp_path):
    """Two samples with an optimizer step between them (fine-tuning under capture): the MLP and
    attention references of the second sample use the updated weights: no FAULT."""
    from dumpfactory import compare_written as compare_path

    model = build("llama", layers=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = torch.randint(1, 120, (1, 12))
    with register_hook(model, DumpConfig(dump_path=str(tmp_path), samples=2, progress=False)):
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    result = compare_path(str(tmp_path))
    assert "FAULT" not in set(result.layers["verdict"]), result.layers.head()
