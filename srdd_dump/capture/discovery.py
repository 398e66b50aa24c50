"""Find the stack of repeated blocks (decoder/encoder layers) inside a model."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import NamedTuple

import torch
from torch import nn

from ..errors import UserError
from ..vocabulary import (  # noqa: F401 (the roles, read from here by the capture modules)
    ACTIVATION,
    ATTENTION_NAMES,
    CLIPPING,
    CORE,
    EXPERT,
    EXPERT_SLOTS,
    EXPERTS,
    LINEAR,
    MLP_NAMES,
    NORM,
    ROTARY,
    ROUTER,
    ROW_WISE,
    SUBLAYER,
)
from . import serving
from .option_names import option


class NoBlocksFound(UserError):
    """No block stack in a model; the message names the largest candidates."""


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module, pattern: str | None = None) -> list[tuple[str, nn.Module]]:
    """Return [(qualified name, module)] of the blocks, in execution order of the stack.

    With ``pattern`` (a glob over module names, e.g. ``model.layers.*``) every matching module
    whose ancestors do not match is a block. Otherwise the stack is the ModuleList/Sequential of
    two or more same-class, parameterised children holding the most parameters: Llama/Qwen2
    ``model.layers``, GPT-2 ``transformer.h``, BERT ``encoder.layer`` and custom models alike.
    """
    if pattern:
        return _by_pattern(model, pattern)
    best: tuple[int, str, nn.Module] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        children = list(module)
        if len({type(c) for c in children}) != 1:
            continue
        size = _params(module)
        if size == 0:
            continue
        if best is None or size > best[0]:
            best = (size, name, module)
    if best is None:
        raise NoBlocksFound(_nothing_found(model))
    _, name, stack = best
    prefix = f"{name}." if name else ""
    return [(f"{prefix}{i}", block) for i, block in enumerate(stack)]


def _by_pattern(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    matched: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name or not fnmatchcase(name, pattern):
            continue
        if any(name.startswith(parent + ".") for parent, _ in matched):
            continue
        matched.append((name, module))
    if not matched:
        raise NoBlocksFound(
            f"{option('layers')} {pattern!r} matches no module of {type(model).__name__}; "
            + _largest(model)
        )
    return matched


def _largest(model: nn.Module, n: int = 3) -> str:
    sized = [(_params(m), name, m) for name, m in model.named_modules() if name]
    sized.sort(key=lambda t: -t[0])
    if not sized:
        return "the model has no submodules"
    parts = [
        f"{name} ({type(m).__name__}, {size / 1e6:.2f}M params, "
        f"{len(list(m.children()))} children)"
        for size, name, m in sized[:n]
    ]
    return "largest candidates: " + "; ".join(parts)


def _nothing_found(model: nn.Module) -> str:
    return (
        f"no stack of repeated blocks found in {type(model).__name__}; {_largest(model)}; "
        f"name the blocks with {option('layers')} (e.g. 'model.layers.*')"
    )


SUBLAYER_NAMES = ("self_attn", "attn", "attention", "self_attention", "mlp", "feed_forward", "ffn")

_CLIPPING_CLASSES = ("ReLU", "ReLU6", "Hardtanh", "Hardsigmoid", "Hardswish", "Threshold",
                     "ReLUSquaredActivation", "ReLUActivation",
                     # serving engines' gated activations that clamp or floor by design
                     # (vLLM's gpt-oss / step SwiGLU, FATReLU)
                     "SwigluOAIAndMul", "SiluAndMulWithClamp", "SwigluStepAndMul",
                     "FatreluAndMul")
# serving engines' own activation ops (vLLM's CustomOp classes, vLLM-Ascend's alike): the
# gated ones take the gate and up projections side by side and return their product
_ACTIVATION_CLASSES = ("GELUTanh", "QuickGELU", "SwiGLU", "FastGELU", "NewGELU", "XIELU")
_GATED_ACTIVATION_SUFFIXES = ("AndMul", "AndMulSparse", "MulAndSilu")


class Site(NamedTuple):
    layer: int  # the block it belongs to (a model-level rotary embedding: block 0)
    name: str  # qualified module name; the attention core is "<attention>.core"
    module: nn.Module  # the module whose output it is (the core: the output projection)
    role: str
    expert: int = -1  # an EXPERT site: the expert's index in its fused module


def find_sites(
    blocks: list[tuple[str, nn.Module]], patterns: str | None = None
) -> list[Site]:
    """Sub-layer modules of every block.

    Default: the attention and MLP children (``self_attn``/``attn``/``attention`` and
    ``mlp``/``feed_forward``/``ffn``). ``patterns``: comma-separated globs over module names
    relative to the block, e.g. ``"self_attn,mlp.down_proj"``.
    """
    globs = [p.strip() for p in patterns.split(",")] if patterns else list(SUBLAYER_NAMES)
    sites = []
    for index, (block_name, block) in enumerate(blocks):
        for name, module in block.named_modules():
            if name and any(fnmatchcase(name, g) for g in globs):
                sites.append(Site(index, f"{block_name}.{name}", module, _role(module)))
    if patterns and not sites:
        raise NoBlocksFound(f"{option('sublayers')} {patterns!r} matches no module inside the "
                            "blocks")
    return sites + find_moe_sites(blocks)


def fused_experts(module: nn.Module) -> int:
    """The number of experts of a fused experts module (transformers 5's Mixtral/Qwen-MoE/
    DeepSeek ``experts``: 3-D weights [E, ...] called as ``experts(hidden, top_k_index,
    top_k_weights)``), else 0."""
    weights = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    if not weights or not weights[0].is_floating_point():
        return 0
    sig = serving.signature(module)
    params = list(sig.parameters) if sig is not None else []
    if len(params) < 3 or not any("index" in p or "indices" in p for p in params):
        return 0
    return int(getattr(module, "num_experts", weights[0].shape[0]))


def _router(moe: nn.Module, experts: int) -> tuple[str, nn.Module] | None:
    """The router of an MoE block: the child whose weight has one row per expert of the model
    (a multiple of the experts module's own count under expert parallelism)."""
    for name, child in moe.named_children():
        weight = getattr(child, "weight", None)
        if (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] > 1
                and weight.shape[0] % experts == 0 and fused_experts(child) == 0):
            return name, child
    return None


def find_moe_sites(blocks: list[tuple[str, nn.Module]]) -> list[Site]:
    """The router, the fused experts, their token slots and one site per expert of every MoE
    block."""
    sites = []
    for index, (block_name, block) in enumerate(blocks):
        modules = dict(block.named_modules())
        for name, module in modules.items():
            n = fused_experts(module) if name else 0
            if not n:
                continue
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            router = _router(modules[parent], n) if parent in modules else None
            if router is not None:
                sites.append(Site(index, f"{block_name}.{parent}.{router[0]}", router[1], ROUTER))
            full = f"{block_name}.{name}"
            sites.append(Site(index, full, module, EXPERTS))
            if router is not None and router[1].weight.shape[0] != n:
                # expert parallelism: this rank holds n of the router's experts and its
                # experts call communicates; re-running it from one rank's capture could
                # hang the others, so its experts are captured as their sum only
                continue
            sites.append(Site(index, f"{full}.slots", module, EXPERT_SLOTS))
            sites += [Site(index, f"{full}.{e}", module, EXPERT, e) for e in range(n)]
    return sites


def operator_role(module: nn.Module) -> str | None:
    """linear, norm, act or rotary by module type (generic: class names for the model-specific
    kinds), None for anything else (containers, dropout, embeddings)."""
    cls = type(module).__name__
    weight = getattr(module, "weight", None)
    floating = isinstance(weight, torch.Tensor) and weight.is_floating_point()
    if floating and (isinstance(module, nn.Linear) or (cls == "Conv1D" and weight.dim() == 2)
                     or (cls.endswith("Linear") and weight.dim() in (1, 2)
                         and (weight.dim() == 2 or weight.numel() == 0)
                         and not list(module.children()))):
        # int8/4-bit weights (bitsandbytes, quantised kernels) are not linear maps; serving
        # engines' own linear classes are (vLLM's QKVParallelLinear, RowParallelLinear, ...;
        # on CPU vLLM may hand the weight to oneDNN and leave an empty one)
        return LINEAR
    if "Rotary" in cls:
        return ROTARY
    if list(module.children()):
        return None
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or cls.endswith(("Norm", "NormFp32")):
        return NORM
    # by the class or a base class: a plugin's subclass of a serving engine's op (vLLM-Ascend's
    # AscendSiluAndMul)
    names = class_names(module)
    if any(n in _CLIPPING_CLASSES for n in names):
        return CLIPPING
    if (type(module).__module__ == "torch.nn.modules.activation"
            or any(n.endswith(("Activation", *_GATED_ACTIVATION_SUFFIXES))
                   or n in _ACTIVATION_CLASSES for n in names)):
        return ACTIVATION
    return None


def class_names(module: object) -> list[str]:
    """The names of a module's class and its bases."""
    return [c.__name__ for c in type(module).__mro__]


# where a block keeps its activation (Hugging Face's MLPs): a module of a class srdd-dump
# does not know held there (a port's own fused kernel) is an activation site all the same
ACTIVATION_NAMES = ("act_fn", "act", "activation_fn", "activation")


def _named_activation(name: str, module: nn.Module) -> bool:
    """An activation by where it is held: a leaf module without weights named act_fn, ...,
    called on one tensor (its replays pass the probe rows alone: a fused SwiGLU of
    ``(gate, up)`` is not one)."""
    if (name.rsplit(".", 1)[-1] not in ACTIVATION_NAMES or list(module.children())
            or list(module.parameters(recurse=False))):
        return False
    sig = serving.signature(module)
    if sig is None:
        return False
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return len(positional) >= 1 and len(required) == 1


def find_operators(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[Site]:
    """The operators inside every block, in registration order: every linear map,
    normalisation, activation and rotary embedding module, and the attention core (as the input
    of the attention's last linear map: its output projection). A rotary embedding held by
    the model rather than by each block (Hugging Face Llama/Qwen2) is one site of block 0, and
    so is a module every block holds (vLLM's shared rotary embedding)."""
    sites: list[Site] = []
    inside: set[int] = set()
    for index, (block_name, block) in enumerate(blocks):
        fused = [name for name, m in block.named_modules() if name and fused_experts(m)]
        for name, module in block.named_modules():
            if id(module) in inside:
                # one module held by several blocks (vLLM's rotary embedding, shared by every
                # layer): one site, of the first block; its hook records the round's first call
                continue
            inside.add(id(module))
            role = operator_role(module) if name else None
            if role is None and name and _named_activation(name, module):
                role = ACTIVATION
            if any(name == f or name.startswith(f + ".") for f in fused):
                role = None  # a fused experts module's insides run on routed tokens only
            if role is not None:
                sites.append(Site(index, f"{block_name}.{name}", module, role))
            if name.rsplit(".", 1)[-1] in ATTENTION_NAMES:
                last = [(n, m) for n, m in module.named_modules()
                        if n and operator_role(m) == LINEAR]
                if last:
                    sites.append(Site(index, f"{block_name}.{name}.core", last[-1][1], CORE))
    shared = [(name, m) for name, m in model.named_modules()
              if id(m) not in inside and operator_role(m) == ROTARY]
    for name, module in shared[:1]:
        sites.insert(0, Site(0, name, module, ROTARY))
    return sites


def _role(module: nn.Module) -> str:
    return operator_role(module) or SUBLAYER
