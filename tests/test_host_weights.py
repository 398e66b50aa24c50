"""The references' host weights: converted into one reused buffer at each call (float64 for a
float64 model's rows, float32 for any other), each result its own tensor, exact, and always the
weights as they are now."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from srdd_dump import DumpConfig, register_hook
from srdd_dump.capture.host_weights import HostWeights, reference_dtype

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
def test_the_reused_buffer_gives_exact_results_each_its_own(dtype):
    modules = _linears(dtype)
    x = {16: torch.randn(5, 16, dtype=torch.float64), 40: torch.randn(5, 40, dtype=torch.float64)}
    weights = HostWeights()
    held = []
    for _ in range(2):  # twice: the second pass reuses the grown buffer
        for m in modules:
            y = weights.linear(m, x[m.in_features])
            assert torch.equal(y, _exact(m, x[m.in_features]))
            held.append((m, y))
    # a result is its own tensor: later conversions into the buffer leave it as it was
    for m, y in held:
        assert torch.equal(y, _exact(m, x[m.in_features]))


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float32_rows_get_float32_products_of_the_exact_weights(dtype):
    """A float32 reference (any model but a float64 one): the weights converted exactly (or, in
    float32 on the host, read as they are: nothing is copied), the product a float32 one,
    within float32's rounding of the float64 product."""
    modules = _linears(dtype)
    weights = HostWeights()
    for m in modules:
        x = torch.randn(5, m.in_features, dtype=torch.float64)
        y = weights.linear(m, x.float())
        assert y.dtype == torch.float32
        w = m.weight.detach().float()
        expect = x.float() @ w.T + (0 if m.bias is None else m.bias.detach().float())
        assert torch.equal(y, expect)
        torch.testing.assert_close(y.double(), _exact(m, x), rtol=1e-5, atol=1e-5)
    # an fp32 host weight is read in place: no float32 scratch buffer was made for it
    assert (torch.float32 in weights._scratch) == (dtype != torch.float32)


@pytest.mark.unit
def test_the_reference_dtype_is_float32_but_for_a_float64_model():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert reference_dtype(torch.zeros(2, dtype=dtype)) == torch.float32
    assert reference_dtype(torch.zeros(2, dtype=torch.float64)) == torch.float64


@pytest.mark.unit
def test_the_weights_follow_a_change_of_the_model():
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
    bf16 = nn.Linear(16, 8).to(torch.bfloat16)  # a weight numpy has no dtype for
    torch.testing.assert_close(weights.linear(bf16, x), _exact(bf16, x), rtol=0, atol=0)


@pytest.mark.unit
def test_a_buffer_made_under_inference_mode_serves_a_later_call_outside_it():
    """A first probed round under torch.inference_mode (an eval pass), the next under no_grad
    or with grad on (fine-tuning): the reused buffers take both."""
    layer = nn.Linear(16, 8)
    weights = HostWeights()
    x = torch.randn(3, 16, dtype=torch.float64)
    with torch.inference_mode():
        first = weights.linear(layer, x)
    with torch.no_grad():
        second = weights.linear(layer, x)
    third = weights.linear(layer, x)
    for y in (first, second, third):
        torch.testing.assert_close(y, _exact(layer, x), rtol=0, atol=0)


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


def test_a_model_cast_to_bfloat16_between_samples_is_judged_by_bfloat16_limits(tmp_path):
    """Generation in float32, then the model cast to bfloat16 and run again under the same
    session (comparing precisions in one script): the bf16 rounds' references differ by bf16
    rounding, which float32 limits would call a fault in every layer."""
    from dumpfactory import compare_written as compare_path

    model = build("llama", layers=3)
    ids = torch.randint(1, 120, (1, 12))
    with register_hook(model, DumpConfig(dump_path=str(tmp_path), samples=2, probe_samples=2,
                                         progress=False)), torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        model.to(torch.bfloat16)
        model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    result = compare_path(str(tmp_path))
    assert result.files["rounds"].iloc[0] >= 2
    assert "FAULT" not in set(result.layers["verdict"]), result.layers.head()
