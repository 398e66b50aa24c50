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
    gate: nn.Linear
    up: nn.Linear
    down: nn.Linear
    activation: Callable[[torch.Tensor], torch.Tensor]


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
    linear = [children.get(n) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(m, nn.Linear) and m.weight.is_floating_point() for m in linear):
        return NOT_GATED
    act = children.get("act_fn") or children.get("act")
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
        return linear(layout.down, layout.activation(linear(layout.gate, x))
                      * linear(layout.up, x))
