"""Find the stack of repeated blocks (decoder/encoder layers) inside a model."""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from ..errors import UserError


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
            f"--layers {pattern!r} matches no module of {type(model).__name__}; "
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
        "name the blocks with --layers PATTERN (e.g. 'model.layers.*')"
    )


SUBLAYER_NAMES = ("self_attn", "attn", "attention", "self_attention", "mlp", "feed_forward", "ffn")


def find_sites(
    blocks: list[tuple[str, nn.Module]], patterns: str | None = None
) -> list[tuple[int, str, nn.Module]]:
    """Sub-layer modules of every block: [(block index, qualified name, module)].

    Default: the attention and MLP children (``self_attn``/``attn``/``attention`` and
    ``mlp``/``feed_forward``/``ffn``). ``patterns``: comma-separated globs over module names
    relative to the block, e.g. ``"self_attn,mlp.down_proj"``.
    """
    globs = [p.strip() for p in patterns.split(",")] if patterns else list(SUBLAYER_NAMES)
    sites = []
    for index, (block_name, block) in enumerate(blocks):
        for name, module in block.named_modules():
            if name and any(fnmatchcase(name, g) for g in globs):
                sites.append((index, f"{block_name}.{name}", module))
    if patterns and not sites:
        raise NoBlocksFound(f"--sublayers {patterns!r} matches no module inside the blocks")
    return sites
