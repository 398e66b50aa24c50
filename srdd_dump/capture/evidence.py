"""The evidence a session's sites give, in the coverage families' words ("prefill attention
probes", "decode operator host replays"...: format/coverage.py), and the sites a granularity
asks for."""

from __future__ import annotations

from ..format import schema
from ..format.coverage import Coverage
from ..vocabulary import (
    EXPERT,
    EXPERT_SLOTS,
    EXPERTS,
    ROTARY,
    ROW_WISE,
    SUBLAYER,
    sublayer_kind,
)
from .discovery import Site


def evidence_level(site: Site) -> str:
    """What a site is: attention, MLP, sub-layer, operator or expert."""
    if site.role == EXPERTS:
        return "expert"
    if site.role in ROW_WISE:
        return "operator"
    return {"attention": "attention", "mlp": "MLP"}.get(sublayer_kind(site.role, site.name),
                                                       "sub-layer")


def levels_of(sites: list[Site]) -> dict[int, str]:
    """Site index -> its level; -1 (a block) -> "block"."""
    return {-1: "block", **{i: evidence_level(site) for i, site in enumerate(sites)}}


def family(phase: str, level: str, what: str) -> str:
    """A coverage family: "decode block probes", "prefill operator host replays"..."""
    return f"{phase} {level} {what}"


def expect_sites(coverage: Coverage, sites: list[Site], n_blocks: int, granularity: str
                 ) -> None:
    """A granularity asked for that found no module to capture is evidence missing."""
    levels = {"sublayer": ("sub-layer sites", lambda s: s.role == SUBLAYER,
                           "no attention or MLP module found inside the blocks"),
              "op": ("operator sites", lambda s: s.role in ROW_WISE,
                     "no linear, norm or activation module found inside the blocks")}
    wanted = ["sublayer"] + (["op"] if granularity == "op" else [])
    for level in wanted if granularity != "block" else []:
        name, is_level, why = levels[level]
        coverage.expect(name, n_blocks)
        found = {s.layer for s in sites if is_level(s)}
        for _ in found:
            coverage.ran(name)
        if not found:
            coverage.failed(name, why)


def never_run(layer_names: list[str], sites: list[Site], fired: set[tuple[int, int]]
              ) -> list[str]:
    """Blocks and sites whose hooks never ran in a captured round (``fired``: the (layer,
    site) pairs whose hooks did; a block is site -1)."""
    blocks = [name for i, name in enumerate(layer_names) if (i, schema.BLOCK_SITE) not in fired]
    # a model-level rotary and the experts' slots and expert sites have no hook of their own
    return blocks + [site.name for i, site in enumerate(sites)
                     if site.role not in (ROTARY, EXPERT_SLOTS, EXPERT)
                     and (site.layer, i) not in fired]
