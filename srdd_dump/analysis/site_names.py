"""Sites of two implementations of one model paired by name: the same sub-layer or operator
under another name (HF ``self_attn.o_proj``, Meta ``attention.wo``, GPT-NeoX ``attention.dense``),
and fused projections against split ones (vLLM's ``qkv_proj`` against ``q_proj``, ``k_proj``,
``v_proj``; ``gate_up_proj`` against ``gate_proj``, ``up_proj``), whose output is the
concatenation of the split ones' along the last dimension.

Names are taken relative to their block (``model.layers.3.self_attn.q_proj`` ->
``self_attn.q_proj``) and pair within paired blocks, in this order: the rules of a mapping file,
the same name, the same canonical name (aliases below), a fused site against its split parts.
What pairs with nothing is returned, never dropped. Pure functions; nothing is read here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# attribute name -> canonical word, whatever the container
ALIASES = {
    "self_attn": "attn", "attn": "attn", "attention": "attn", "self_attention": "attn",
    "mlp": "mlp", "feed_forward": "mlp", "ffn": "mlp",
    "q_proj": "q_proj", "wq": "q_proj", "k_proj": "k_proj", "wk": "k_proj",
    "v_proj": "v_proj", "wv": "v_proj", "o_proj": "o_proj", "wo": "o_proj",
    "out_proj": "o_proj",
    # fused q|k|v projections whose output is [q, k, v] along the last dimension (GPT-NeoX's
    # query_key_value interleaves the heads, so it is not one of them)
    "qkv_proj": "qkv_proj", "W_pack": "qkv_proj", "Wqkv": "qkv_proj", "c_attn": "qkv_proj",
    "gate_proj": "gate_proj", "w1": "gate_proj", "up_proj": "up_proj", "w3": "up_proj",
    "down_proj": "down_proj", "w2": "down_proj", "fc2": "down_proj",
    "gate_up_proj": "gate_up_proj",
    "input_layernorm": "input_norm", "attention_norm": "input_norm", "ln_1": "input_norm",
    "post_attention_layernorm": "post_attention_norm", "ffn_norm": "post_attention_norm",
    "ln_2": "post_attention_norm",
    "act_fn": "act_fn", "act": "act_fn",
}
# (canonical container, attribute) -> canonical word, where the word depends on its container
IN_CONTAINER = {("attn", "dense"): "o_proj", ("attn", "c_proj"): "o_proj",
                ("mlp", "c_proj"): "down_proj", ("mlp", "dense_4h_to_h"): "down_proj"}
# a fused site's canonical last word -> its parts' canonical last words, in output order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

BY_MAPPING = "mapping"
BY_NAME = "name"
BY_ALIAS = "alias"
BY_FUSION = "fused"


@dataclass(frozen=True)
class SiteRule:
    """One rule of a mapping file: my sites (concatenated in order) are the golden sites
    (concatenated in order). Names are relative to the block, or full module names."""

    mine: tuple[str, ...]
    golden: tuple[str, ...]


@dataclass(frozen=True)
class SitePair:
    """Sites of one paired block: my sites' outputs, concatenated along the last dimension in
    order, against the golden sites' (one site on each side unless one of them is fused)."""

    mine: tuple[int, ...]  # site numbers in my dump
    golden: tuple[int, ...]  # site numbers in the golden dump
    how: str  # BY_MAPPING, BY_NAME, BY_ALIAS or BY_FUSION


@dataclass
class SitePairing:
    pairs: list[SitePair] = field(default_factory=list)
    my_unmatched: list[int] = field(default_factory=list)
    golden_unmatched: list[int] = field(default_factory=list)
    rules_used: set[int] = field(default_factory=set)  # indices of the rules that paired


def relative_name(site: str, block: str) -> str:
    """``model.layers.3.self_attn.q_proj`` in block ``model.layers.3`` -> ``self_attn.q_proj``."""
    return site[len(block) + 1:] if block and site.startswith(block + ".") else site


def canonical(relative: str) -> str:
    """The name with every attribute replaced by its canonical word (ALIASES, IN_CONTAINER)."""
    words: list[str] = []
    for part in relative.split("."):
        container = words[-1] if words else ""
        words.append(IN_CONTAINER.get((container, part)) or ALIASES.get(part, part))
    return ".".join(words)


def pair_sites(
    mine: dict[int, str], golden: dict[int, str], my_block: str, golden_block: str,
    rules: tuple[SiteRule, ...] = (),
) -> SitePairing:
    """Pair the sites of one block pair. ``mine`` / ``golden``: site number -> full module
    name, for the sites of that block; ``rules``: a mapping file's, tried first."""
    my_rel = {k: relative_name(v, my_block) for k, v in mine.items()}
    golden_rel = {k: relative_name(v, golden_block) for k, v in golden.items()}
    left_mine, left_golden = dict(my_rel), dict(golden_rel)
    out = SitePairing()

    def take(my_sites: tuple[int, ...], golden_sites: tuple[int, ...], how: str) -> None:
        for k in my_sites:
            left_mine.pop(k)
        for k in golden_sites:
            left_golden.pop(k)
        out.pairs.append(SitePair(my_sites, golden_sites, how))

    for index, rule in enumerate(rules):
        a = _find_all(rule.mine, left_mine, mine)
        b = _find_all(rule.golden, left_golden, golden)
        if a and b:
            take(a, b, BY_MAPPING)
            out.rules_used.add(index)
    for key in (lambda name: name, canonical):
        how = BY_NAME if key is not canonical else BY_ALIAS
        index = {}
        for k, name in left_golden.items():
            index.setdefault(key(name), k)
        for k, name in list(left_mine.items()):
            j = index.get(key(name))
            if j is not None and j in left_golden:
                take((k,), (j,), how)
    for fused_side, parts_side, mine_is_fused in ((left_mine, left_golden, True),
                                                  (left_golden, left_mine, False)):
        by_name = {canonical(name): k for k, name in parts_side.items()}
        for k, name in list(fused_side.items()):
            parts = _parts(canonical(name))
            found = tuple(by_name.get(p) for p in parts)
            if not parts or None in found or any(p not in parts_side for p in found):
                continue
            if mine_is_fused:
                take((k,), found, BY_FUSION)
            else:
                take(found, (k,), BY_FUSION)
    out.my_unmatched = sorted(left_mine)
    out.golden_unmatched = sorted(left_golden)
    return out


def _parts(name: str) -> tuple[str, ...]:
    head, _, last = name.rpartition(".")
    parts = FUSED.get(last)
    if not parts:
        return ()
    return tuple(f"{head}.{p}" if head else p for p in parts)


def _find_all(names: tuple[str, ...], left: dict[int, str], full: dict[int, str]
              ) -> tuple[int, ...]:
    """The site numbers of ``names`` (relative or full) among those still unpaired; () unless
    every one is there."""
    found = []
    for name in names:
        k = next((k for k, rel in left.items() if name in (rel, full[k])), None)
        if k is None:
            return ()
        found.append(k)
    return tuple(found)
