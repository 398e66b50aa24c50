"""The model's own number of each captured block: a dump of some blocks (``--layers
'model.layers.1[0-2]'``) stores them at positions 0, 1, 2 of ``/layers``, and the user knows
them as layers 10, 11, 12. Both sides use these numbers where a user reads or writes a layer
number (``--inject layer=K``, the report's ``layer`` column, the headline); the file's positions
stay the records' keys."""

from __future__ import annotations

import re
from collections.abc import Sequence

_TRAILING = re.compile(r"(\d+)$")


def layer_numbers(names: Sequence[str]) -> list[int]:
    """Each block's number: the last all-digit part of its module name (``model.layers.10`` and
    ``model.layers.10.mlp`` -> 10), else the integer the name ends with (``block7``), when
    every name has one and they increase in stack order (one numbered stack), else its
    position (two stacks, an encoder's and a decoder's, or names without numbers)."""
    numbers = [_number(str(name)) for name in names]
    if None in numbers or any(b <= a for a, b in zip(numbers, numbers[1:])):
        return list(range(len(names)))
    return numbers


def _number(name: str) -> int | None:
    parts = [part for part in name.split(".") if part.isdigit()]
    if parts:
        return int(parts[-1])
    found = _TRAILING.search(name)
    return int(found.group(1)) if found else None


def number_of(numbers: Sequence[int], position: int | None) -> int | None:
    """The number of the block at ``position``; other positions (the stack input, -1; None)
    unchanged."""
    if position is None or not 0 <= position < len(numbers):
        return position
    return numbers[position]
