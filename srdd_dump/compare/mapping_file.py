"""A site mapping file (``srdd-compare --baseline ... --mapping FILE``): the sites of my dump
and of the golden dump that are one computation under names the automatic pairing
(``analysis.site_names``) does not know, in the spirit of msprobe's layer mapping.

    # my site: golden site(s); names relative to the block (model.layers.N) or full names;
    # a list or "a + b" is the concatenation of their outputs along the last dimension
    sites:
      attention.wqkv: [self_attn.q_proj, self_attn.k_proj, self_attn.v_proj]
      mlp.w13: mlp.gate_up_proj
      mlp.w2:
        - mlp.down_proj

The file is the YAML subset above (a ``sites:`` table of names, flow lists, block lists and
comments), read by the few lines below: no YAML library, which could build objects from tags,
is used on the compare side.
"""

from __future__ import annotations

import re

from ..analysis.site_names import SiteRule
from ..errors import UserError

SITES_KEY = "sites"
NAME = re.compile(r"^[A-Za-z_][\w.\-]*$")
ENTRY = re.compile(r"^(?P<key>[^:#\s][^:#]*?)\s*:\s*(?P<value>.*)$")
SHAPE = "expected a 'sites:' table of 'my site: golden site(s)' lines"


def read_mapping(path: str) -> tuple[SiteRule, ...]:
    """The rules of the mapping file at ``path``; UserError, one line, when it is not one."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise UserError(f"--mapping {path}: cannot read it ({why})") from None
    table: list[tuple[int, str, list[str]]] = []  # (line, my site, golden sites)
    in_sites = listing = False  # inside the sites table; an entry's block list is open
    for number, raw in enumerate(lines, start=1):
        text = raw.split("#", 1)[0].rstrip()
        if not text.strip():
            continue
        indent = len(text) - len(text.lstrip())
        item = text.strip()
        if item.startswith("- "):
            if not listing or indent == 0:
                raise UserError(f"--mapping {path}: line {number}: a list item outside an "
                                "entry")
            table[-1][2].append(_one_name(path, number, item[2:].strip()))
            continue
        found = ENTRY.match(item)
        if found is None:
            raise UserError(f"--mapping {path}: line {number}: not valid here ({SHAPE})")
        key, value = found["key"].strip().strip("'\""), found["value"].strip()
        if indent == 0 and key == SITES_KEY and not value:
            in_sites = True
            continue
        if indent == 0 and in_sites:
            raise UserError(f"--mapping {path}: line {number}: '{key}' is not part of the "
                            f"'{SITES_KEY}:' table")
        golden = _names(path, number, value) if value else []
        listing = not value
        table.append((number, _name(path, number, key), golden))
    if not table:
        raise UserError(f"--mapping {path}: {SHAPE}")
    rules = []
    for number, mine, golden in table:
        if not golden:
            raise UserError(f"--mapping {path}: line {number}: '{mine}' names no golden site")
        rules.append(SiteRule(tuple(p.strip() for p in mine.split("+")), tuple(golden)))
    return tuple(rules)


def _names(path: str, number: int, value: str) -> list[str]:
    """A flow list ``[a, b]``, ``a + b`` or one name."""
    if value.startswith("["):
        if not value.endswith("]"):
            raise UserError(f"--mapping {path}: line {number}: an unclosed list")
        return [_one_name(path, number, p) for p in value[1:-1].split(",")]
    return [_name(path, number, p) for p in value.split("+")]


def _one_name(path: str, number: int, name: str) -> str:
    """A list item: one module name (a list is already the concatenation of its items)."""
    if "+" in name:
        raise UserError(f"--mapping {path}: line {number}: '{name.strip()}': a list item is "
                        "one name (write the parts as items of the list)")
    return _name(path, number, name)


def _name(path: str, number: int, name: str) -> str:
    name = name.strip().strip("'\"")
    if not all(NAME.match(p.strip()) for p in name.split("+")):
        raise UserError(f"--mapping {path}: line {number}: '{name}' is not a module name "
                        "('my site: golden site(s)')")
    return name
