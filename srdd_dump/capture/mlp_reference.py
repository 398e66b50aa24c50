"""The MLP sub-layer recomputed from its own input on the host, for the probe rows only
(docs/method.md, "Reference MLP"), in float32 (float64 for a float64 model:
host_weights.reference_dtype): a gated MLP ``down(act(gate(x)) * up(x))`` from its weights and
srdd-dump's own activation (chosen by the activation module's class, computed by formula), so a
fault inside an operator of the MLP (a flush-to-zero in a projection, a clamp in the
activation, a lower precision) shows at default options, where the sub-layer output is the
finest site. Each output row depends on its input row alone, so the probe rows are all it
computes.

Each call converts the weights to that dtype on the host (host_weights.py).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from .discovery import ACTIVATION_NAMES, class_names
from .host import HELD_ELSEWHERE, weight_held_elsewhere
from .host_weights import HOST, HostWeights, reference_dtype


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
    # the activation module's class was unknown: "ClassName as the config's 'silu'"
    assumed: str = ""


# serving engines' gated activation ops (vLLM's CustomOp classes, and a plugin's subclasses of
# them: vLLM-Ascend's AscendSiluAndMul): the formula of the gate half, and whether the gate
# is the first half of their input
GATED: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "SiluAndMul": (ACTIVATIONS["SiLU"], True), "MulAndSilu": (ACTIVATIONS["SiLU"], False),
    "GeluAndMul": (_gelu, True),
}
# the activations a model's config names (transformers' ACT2FN keys), by formula
CONFIG_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": ACTIVATIONS["SiLU"], "swish": ACTIVATIONS["SiLU"], "gelu": _gelu,
    "gelu_pytorch_tanh": _gelu_tanh, "gelu_new": _gelu_tanh, "gelu_tanh": _gelu_tanh,
    "relu": torch.relu,
}
# MLPs that get no reference and are not missing evidence: not a gated MLP of a known layout
NOT_GATED = "no gate_proj / up_proj / down_proj floating-point torch Linear modules"
NO_ACTIVATION = "no activation module (the activation is a function call)"
SILENT = (NOT_GATED, NO_ACTIVATION)
PLAIN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# a linear map that is not ``x @ W.T + b`` of its weight alone: quantised (a scale), LoRA
QUANTISED_OR_ADAPTED = ("weight_scale", "weight_scale_inv", "input_scale", "base_layer",
                        "lora_a_stacked", "qweight", "scales")


def _gated(act: nn.Module | None) -> tuple[Callable[[torch.Tensor], torch.Tensor], bool] | None:
    for name in class_names(act):
        if name == "GeluAndMul" and getattr(act, "approximate", "none") == "tanh":
            return _gelu_tanh, True
        if name in GATED:
            return GATED[name]
    return None


def activation_of(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The activation's formula, by its module class (``nn.GELU`` by its ``approximate``)."""
    name = type(module).__name__
    if name == "GELU":
        return _gelu_tanh if getattr(module, "approximate", "none") == "tanh" else _gelu
    return ACTIVATIONS.get(name)


def configured_activation(config: Any) -> str | None:
    """The activation a model's config names (``hidden_activation`` first, as Gemma reads it,
    then ``hidden_act``; a multimodal model's text config too), if srdd-dump has its formula."""
    for c in (config, getattr(config, "text_config", None)):
        for key in ("hidden_activation", "hidden_act"):
            name = getattr(c, key, None)
            if isinstance(name, str) and name in CONFIG_ACTIVATIONS:
                return name
    return None


def _unusable(m: Any) -> str | None:
    """Why a projection's host copy is not the map it computes (None: it is)."""
    w = getattr(m, "weight", None)
    if isinstance(m, nn.Module) and weight_held_elsewhere(m):
        return HELD_ELSEWHERE
    if not isinstance(m, nn.Module) or not isinstance(w, torch.Tensor) or w.dim() != 2:
        return NOT_GATED
    if (w.dtype not in PLAIN_DTYPES or any(hasattr(m, a) for a in QUANTISED_OR_ADAPTED)
            or (hasattr(m, "quant_method")
                and "UnquantizedLinearMethod" not in class_names(m.quant_method))):
        return f"a quantised or adapted projection ({type(m).__name__}, weight {w.dtype})"
    if getattr(m, "tp_size", 1) != 1:
        return "projections split over tensor-parallel ranks"
    return None


def mlp_layout(module: nn.Module, config: Any = None) -> MlpLayout | str:
    """The layout of a gated MLP (Hugging Face's three projections, or a serving engine's fused
    gate_up_proj); a string says why none. An activation module of a class srdd-dump has no
    formula for (a port's own kernel put in place of the model's) is taken to compute the
    activation the model's config names (``assumed`` says so): the reference is the model as
    configured, so a kernel that clamps or flushes differs from it."""
    children = dict(module.named_children())
    act = next((children[n] for n in ACTIVATION_NAMES if n in children), None)
    if any(n.endswith("_multiplier") for n in vars(module)):
        # Falcon-H1's gate and down multipliers: not the plain formula
        return f"an MLP with scaling factors of its own ({type(module).__name__})"
    fused = children.get("gate_up_proj")
    if fused is not None and _gated(act) is not None:
        return _fused_layout(fused, children.get("down_proj"), act)
    linear = [children.get(n) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(m, nn.Linear) and m.weight.is_floating_point() for m in linear):
        return NOT_GATED
    if act is None:
        return NO_ACTIVATION
    why = next(filter(None, map(_unusable, linear)), None)
    if why:
        return why
    formula, assumed = activation_of(act), ""
    if formula is None and (name := configured_activation(config)) is not None:
        formula = CONFIG_ACTIVATIONS[name]
        assumed = f"{type(act).__name__} as the config's {name!r}"
    if formula is None:
        return (f"an activation srdd-dump has no formula for ({type(act).__name__}) and the "
                "model's config names none it has")
    gate, up, down = linear
    if gate.out_features != up.out_features or down.in_features != up.out_features:
        return "projections of mismatched widths (sharded?)"
    return MlpLayout(gate, up, down, formula, assumed=assumed)


def _fused_layout(gate_up: nn.Module, down: Any, act: nn.Module) -> MlpLayout | str:
    """vLLM's MLP: ``down(act_and_mul(gate_up(x)))``, the gate and up projections' outputs side
    by side in one linear map."""
    why = _unusable(gate_up) or _unusable(down)
    if why:
        return why
    if gate_up.weight.shape[0] != 2 * down.weight.shape[1]:
        return "projections of mismatched widths (sharded?)"
    formula, gate_first = _gated(act)
    return MlpLayout(gate_up, None, down, formula, gate_first)


class MlpReference:
    """Reference outputs of the probe rows of recognised MLPs."""

    def __init__(self, modules: list[nn.Module], weights: HostWeights, config: Any = None):
        self.layouts = {id(m): mlp_layout(m, config) for m in modules}
        self.weights = weights
        # activation modules of unknown classes taken to compute the config's activation
        self.assumed = sorted({layout.assumed for layout in self.layouts.values()
                               if isinstance(layout, MlpLayout) and layout.assumed})

    def rows(self, module: nn.Module, x_rows: torch.Tensor) -> torch.Tensor:
        """The reference output of input rows (n, hidden): (n, hidden), float32 (float64 for
        float64 rows)."""
        layout = self.layouts[id(module)]
        x = x_rows.detach().to(HOST, reference_dtype(x_rows))
        linear = self.weights.linear
        if layout.up is not None:
            return linear(layout.down, layout.activation(linear(layout.gate, x))
                          * linear(layout.up, x))
        first, second = linear(layout.gate, x).chunk(2, dim=-1)
        gate, up = (first, second) if layout.gate_first else (second, first)
        return linear(layout.down, layout.activation(gate) * up)
