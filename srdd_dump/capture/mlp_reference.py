"""The MLP sub-layer recomputed from its own input in float64 on the host, for the probe rows
only (docs/method.md, "Reference MLP"): a gated MLP ``down(act(gate(x)) * up(x))`` from its
weights and srdd-dump's own activation (chosen by the activation module's class, computed by
formula), so a fault inside an operator of the MLP (a flush-to-zero in a projection, a clamp in
the activation, a lower precision) shows at default options, where the sub-layer output is the
finest site. Each output row depends on its input row alone, so the probe rows are all it
computes.

Each call converts the weights to float64 on the host (host_weights.py).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from .host_weights import F64, HOST, HostWeights


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "SiLU": lambda x: x * torch.sigmoid(x), "SiLUActivation": lambda x: x * torch.sigmoid(x),
    "GELUTanh": _gelu_tanh, "PytorchGELUTanh": _gelu_tanh, "NewGELUActivation": _gelu_tanh,
    "GELUActivation": _gelu, "ReLU": torch.relu,
}


class MlpLayout(NamedTuple):
    gate: nn.Module  # a serving engine's fused gate_up_proj: gate and up side by side
    up: nn.Module | None  # None: fused into ``gate``
    down: nn.Module
    activation: Callable[[torch.Tensor], torch.Tensor]
    gate_first: bool = True  # fused: the gate is the first half of the columns


# serving engines' gated activation ops (vLLM's CustomOp classes): the formula of the gate
# half, and whether the gate is the first half of their input
GATED: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "SiluAndMul": (ACTIVATIONS["SiLU"], True), "MulAndSilu": (ACTIVATIONS["SiLU"], False),
    "GeluAndMul": (_gelu, True),
}


def _gated(act: nn.Module | None) -> tuple[Callable[[torch.Tensor], torch.Tensor], bool] | None:
    name = type(act).__name__
    if name == "GeluAndMul" and getattr(act, "approximate", "none") == "tanh":
        return _gelu_tanh, True
    return GATED.get(name)


def _projection(m: Any) -> bool:
    """A linear map whose float64 copy can be made: a 2-D floating weight held here."""
    w = getattr(m, "weight", None)
    return (isinstance(m, nn.Module) and isinstance(w, torch.Tensor) and w.dim() == 2
            and w.is_floating_point())


# the activations a model's config names (transformers' ACT2FN keys), by formula
CONFIG_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": ACTIVATIONS["SiLU"], "swish": ACTIVATIONS["SiLU"], "gelu": _gelu,
    "gelu_pytorch_tanh": _gelu_tanh, "gelu_new": _gelu_tanh, "gelu_tanh": _gelu_tanh,
    "relu": torch.relu,
}
NOT_GATED = "no gate_proj / up_proj / down_proj floating-point torch Linear modules"


def activation_of(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The activation's formula, by its module class (``nn.GELU`` by its ``approximate``)."""
    name = type(module).__name__
    if name == "GELU":
        return _gelu_tanh if getattr(module, "approximate", "none") == "tanh" else _gelu
    return ACTIVATIONS.get(name)


def configured_activation(config: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The formula of the activation a model's config names (``hidden_activation`` first, as
    Gemma reads it, then ``hidden_act``; a multimodal model's text config too)."""
    for c in (config, getattr(config, "text_config", None)):
        for key in ("hidden_activation", "hidden_act"):
            name = getattr(c, key, None)
            if isinstance(name, str) and name in CONFIG_ACTIVATIONS:
                return CONFIG_ACTIVATIONS[name]
    return None


def mlp_layout(module: nn.Module, config: Any = None) -> MlpLayout | str:
    """The layout of a gated MLP of the Hugging Face kind; a string says why not. An
    activation module of a class srdd-dump has no formula for (a port's own fused kernel put
    in place of the model's) is taken to compute the activation the model's config names:
    the reference is the model as configured, so a wrong kernel differs from it."""
    children = dict(module.named_children())
    act = children.get("act_fn") or children.get("act")
    fused = children.get("gate_up_proj")
    if fused is not None and _gated(act) is not None:
        return _fused_layout(fused, children.get("down_proj"), act)
    linear = [children.get(n) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(m, nn.Linear) and m.weight.is_floating_point() for m in linear):
        return NOT_GATED
    formula = activation_of(act) if act is not None else None
    if formula is None and act is not None:
        formula = configured_activation(config)
    if formula is None:
        return (f"an activation srdd-dump has no formula for ({type(act).__name__}) and the "
                "model's config names none it has")
    gate, up, down = linear
    if gate.out_features != up.out_features or down.in_features != up.out_features:
        return "projections of mismatched widths (sharded?)"
    return MlpLayout(gate, up, down, formula)


def _fused_layout(gate_up: nn.Module, down: Any, act: nn.Module) -> MlpLayout | str:
    """vLLM's MLP: ``down(act_and_mul(gate_up(x)))``, the gate and up projections' outputs side
    by side in one linear map."""
    if not (_projection(gate_up) and _projection(down)):
        if any(getattr(m, "weight", None) is not None and m.weight.numel() == 0
               for m in (gate_up, down) if m is not None):
            return ("projections whose weights are kept elsewhere (an empty weight tensor: the "
                    "engine's own packed form, e.g. vLLM's CPU backend)")
        return NOT_GATED
    if any(getattr(m, "tp_size", 1) != 1 for m in (gate_up, down)):
        return "projections split over tensor-parallel ranks"
    if gate_up.weight.shape[0] != 2 * down.weight.shape[1]:
        return "projections of mismatched widths (sharded?)"
    formula, gate_first = _gated(act)
    return MlpLayout(gate_up, None, down, formula, gate_first)


class MlpReference:
    """Float64 reference outputs of the probe rows of recognised MLPs."""

    def __init__(self, modules: list[nn.Module], weights: HostWeights, config: Any = None):
        self.layouts = {id(m): mlp_layout(m, config) for m in modules}
        self.weights = weights

    def rows(self, module: nn.Module, x_rows: torch.Tensor) -> torch.Tensor:
        """The reference output of input rows (n, hidden): (n, hidden) float64."""
        layout = self.layouts[id(module)]
        x = x_rows.detach().to(HOST, F64)
        linear = self.weights.linear
        if layout.up is not None:
            return linear(layout.down, layout.activation(linear(layout.gate, x))
                          * linear(layout.up, x))
        first, second = linear(layout.gate, x).chunk(2, dim=-1)
        gate, up = (first, second) if layout.gate_first else (second, first)
        return linear(layout.down, layout.activation(gate) * up)
