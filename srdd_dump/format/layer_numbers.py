"""The model's own number of each captured block: a dump of some blocks (``--layers
'model.layers.1[0-2]'``) stores them at positions 0, 1, 2 of ``/layers``, and the user knows
them as layers 10, 11, 12. Both sides use these numbers where a user reads or writes a layer
number (``--inject layer=K``, the report's ``layer`` column, the headline); the file's positions
stay the records' keys."""

from __future__ import annotations

import re
from collections.abc import Sequence

# a module of a numbered block: the block itself or one of its children (the first number in
# the path: model.layers.3.mlp.experts.5.up_proj -> model.layers, 3)
NUMBERED_PREFIX = re.compile(r"^(?P<stack>.+?)\.(?P<index>\d+)(?:\.|$)")
_TRAILING = re.compile(r"(\d+)$")


def layer_numbers(names: Sequence[str]) -> list[int]:
    """Each block's number: the first number in its module path (``NUMBERED_PREFIX``, as the
    msprobe reader numbers blocks: ``model.layers.10`` and ``model.layers.10.mlp`` -> 10),
    else the integer its name ends with (``block7``), when every name has one and they
    increase in stack order (one numbered stack), else its position (two stacks, an
    encoder's and a decoder's, or names without numbers)."""
    numbers = [_number(str(name)) for name in names]
    if None in numbers or any(b <= a for a, b in zip(numbers, numbers[1:])):
        return list(range(len(names)))
    return numbers


def _number(name: str) -> int | None:
    found = NUMBERED_PREFIX.match(name) or _TRAILING.search(name)
    return int(found.group(found.lastindex)) if found else None


def after_gap(numbers: Sequence[int]) -> frozenset[int]:
    """The positions whose block before in the dump is not the model's previous block (a gap
    in ``--layers``: 2, then 20): the block there has no recorded input."""
    return frozenset(p for p in range(1, len(numbers)) if numbers[p] != numbers[p - 1] + 1)


def number_of(numbers: Sequence[int], position: int | None) -> int | None:
    """The number of the block at ``position``; other positions (the stack input, -1; None)
    unchanged."""
    if position is None or not 0 <= position < len(numbers):
        return position
    return numbers[position]


def position_of(numbers: Sequence[int], layer: int) -> int | None:
    """The position of the block a user names ``layer`` (``--inject layer=K``): the block the
    model numbers K, or for a negative K the K-th from the last; None when none is."""
    if layer in numbers:
        return list(numbers).index(layer)
    if -len(numbers) <= layer < 0:
        return len(numbers) + layer
    return None


def site_pattern(name: str) -> str:
    """A module name with its layer number as N (``model.layers.4.self_attn.k_norm`` ->
    ``model.layers.N.self_attn.k_norm``): one name for that site of every layer."""
    return re.sub(r"\.\d+(\.|$)", r".N\1", name, count=1)
