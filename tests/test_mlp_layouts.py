"""Which MLPs get a reference (capture/mlp_reference.py) and which activation modules
are operator sites (capture/discovery.py): layouts built from small modules named as Hugging
Face, vLLM and ports name them."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from srdd_dump.capture.discovery import ACTIVATION, CLIPPING, _named_activation, operator_role
from srdd_dump.capture.host import host_copy
from srdd_dump.capture.host_weights import HostWeights
from srdd_dump.capture.mlp_reference import (
    NO_ACTIVATION,
    SILENT,
    MlpLayout,
    MlpReference,
    mlp_layout,
)

pytestmark = pytest.mark.unit


class SiluAndMul(nn.Module):
    def forward(self, x):
        d = x.shape[-1] // 2
        return nn.functional.silu(x[..., :d]) * x[..., d:]


class MulAndSilu(nn.Module):
    def forward(self, x):
        d = x.shape[-1] // 2
        return x[..., :d] * nn.functional.silu(x[..., d:])


class GeluAndMul(nn.Module):
    def __init__(self, approximate="none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x):
        d = x.shape[-1] // 2
        return nn.functional.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


class AscendSiluAndMul(SiluAndMul):  # a plugin's subclass of the engine's op
    pass


class Fused(nn.Module):
    def __init__(self, act, hidden=8, inter=16):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gated(nn.Module):
    def __init__(self, act=None, hidden=8, inter=16):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        if act is not None:
            self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _reference(mlp, config=None):
    torch.manual_seed(0)
    x = torch.randn(5, 8, dtype=torch.float64)
    ref = MlpReference([mlp], HostWeights(), config)
    layout = ref.layouts[id(mlp)]
    assert isinstance(layout, MlpLayout), layout
    with torch.no_grad():
        want = mlp.double()(x)
    return ref.rows(mlp, x), want, ref


@pytest.mark.parametrize("act", [SiluAndMul(), MulAndSilu(), GeluAndMul(), GeluAndMul("tanh"),
                                 AscendSiluAndMul()], ids=lambda a: f"{type(a).__name__}"
                         f"{'-tanh' if getattr(a, 'approximate', '') == 'tanh' else ''}")
def test_a_fused_gate_up_mlp_is_recomputed_with_its_ops_halves(act):
    got, want, _ = _reference(Fused(act))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_an_unknown_activation_class_takes_the_configs_and_says_so():
    class NpuSilu(nn.Module):
        def forward(self, x):
            return nn.functional.silu(x)

    gemma_like = types.SimpleNamespace(hidden_activation="gelu_pytorch_tanh", hidden_act="silu")
    layout = mlp_layout(Gated(NpuSilu()), gemma_like)  # hidden_activation first, as Gemma
    assert isinstance(layout, MlpLayout) and layout.assumed == (
        "NpuSilu as the config's 'gelu_pytorch_tanh'")
    got, want, ref = _reference(Gated(NpuSilu()), types.SimpleNamespace(hidden_act="silu"))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert ref.assumed == ["NpuSilu as the config's 'silu'"]
    assert "no formula" in mlp_layout(Gated(NpuSilu()), types.SimpleNamespace(hidden_act="x"))


def test_mlps_whose_float64_copy_is_not_their_map_are_refused_in_words():
    assert mlp_layout(Gated()) == NO_ACTIVATION and NO_ACTIVATION in SILENT  # a function call
    sharded = Fused(SiluAndMul())
    sharded.gate_up_proj.tp_size = sharded.down_proj.tp_size = 2
    assert "tensor-parallel" in mlp_layout(sharded)
    scaled = Fused(SiluAndMul())
    scaled.down_proj.weight_scale_inv = torch.ones(1)
    assert "quantised" in mlp_layout(scaled)
    if hasattr(torch, "float8_e4m3fn"):
        fp8 = Fused(SiluAndMul())
        fp8.gate_up_proj.weight = nn.Parameter(
            fp8.gate_up_proj.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
        assert "quantised" in mlp_layout(fp8)
    lora = Gated(nn.SiLU())
    lora.up_proj.base_layer = nn.Linear(8, 16)
    assert "adapted" in mlp_layout(lora)
    falcon = Gated(nn.SiLU())
    falcon.gate_multiplier = 0.5
    assert "scaling factors" in mlp_layout(falcon)
    packed = Fused(SiluAndMul())
    packed.gate_up_proj.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    why = mlp_layout(packed)
    assert "kept elsewhere" in why and why not in SILENT
    with pytest.raises(RuntimeError, match="kept elsewhere"):
        host_copy(packed)


def test_activation_operators_by_class_base_class_and_place():
    assert operator_role(SiluAndMul()) == ACTIVATION
    assert operator_role(AscendSiluAndMul()) == ACTIVATION

    class SwigluOAIAndMul(nn.Module):
        def forward(self, x):
            return x

    class AscendSwigluOAIAndMul(SwigluOAIAndMul):
        pass

    assert operator_role(AscendSwigluOAIAndMul()) == CLIPPING  # it clamps by design

    class ClampAct(nn.Module):
        def forward(self, x):
            return x.clamp(-1, 1)

    class FusedSwiGLU(nn.Module):
        def forward(self, gate, up):
            return nn.functional.silu(gate) * up

    assert operator_role(ClampAct()) is None
    assert _named_activation("mlp.act_fn", ClampAct())
    assert not _named_activation("mlp.act_fn", FusedSwiGLU())  # its replay passes one tensor
    assert not _named_activation("mlp.clamp", ClampAct())
