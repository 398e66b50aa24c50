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
    """Each block's number: the integer its module name ends with (``model.layers.10`` -> 10)
    when every name ends with one and they increase in stack order (one numbered stack),
    else its position (two stacks, an encoder's and a decoder's, or names without numbers)."""
    found = [_TRAILING.search(str(name)) for name in names]
    if not all(found):
        return list(range(len(names)))
    numbers = [int(m.group(1)) for m in found]
    if any(b <= a for a, b in zip(numbers, numbers[1:])):
        return list(range(len(names)))
    return numbers


def number_of(numbers: Sequence[int], position: int | None) -> int | None:
    """The number of the block at ``position``; other positions (the stack input, -1; None)
    unchanged."""
    if position is None or not 0 <= position < len(numbers):
        return position
    return numbers[position]
