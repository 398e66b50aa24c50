"""A site mapping file (``srdd-compare --baseline ... --mapping FILE``): the sites of my dump
and of the golden dump that are one computation under names the automatic pairing
(``analysis.site_names``) does not know, in the spirit of msprobe's layer mapping.

    # my site: golden site(s); names relative to the block (model.layers.N) or full names;
    # a list or "a + b" is the concatenation of their outputs along the last dimension
    sites:
      attention.wqkv: [self_attn.q_proj, self_attn.k_proj, self_attn.v_proj]
      mlp.w13: mlp.gate_up_proj
"""

from __future__ import annotations

from ..analysis.site_names import SiteRule
from ..errors import UserError

SITES_KEY = "sites"


def read_mapping(path: str) -> tuple[SiteRule, ...]:
    """The rules of the mapping file at ``path``; UserError, one line, when it is not one."""
    try:
        import yaml
    except ImportError:
        raise UserError("--mapping needs PyYAML: pip install pyyaml") from None
    try:
        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
    except OSError as exc:
        raise UserError(f"--mapping {path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise UserError(f"--mapping {path}: not valid YAML{where}") from None
    table = doc.get(SITES_KEY, doc) if isinstance(doc, dict) else doc
    if not isinstance(table, dict) or not table:
        raise UserError(f"--mapping {path}: expected a '{SITES_KEY}:' table of 'my site: golden "
                        "site(s)' lines")
    rules = []
    for mine, golden in table.items():
        a, b = _names(mine), _names(golden)
        if not a or not b:
            raise UserError(f"--mapping {path}: '{mine}: {golden}' is not 'my site: golden "
                            "site(s)' (names, a list or 'a + b')")
        rules.append(SiteRule(a, b))
    return tuple(rules)


def _names(value) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(p.strip() for p in value.split("+") if p.strip())
    if isinstance(value, list) and all(isinstance(v, str) and v.strip() for v in value):
        return tuple(v.strip() for v in value)
    return ()
