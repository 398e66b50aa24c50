"""How each site role is captured: how it is hooked and how it is replayed. One row per role
(the roles themselves: srdd_dump/vocabulary.py); a new role is one row here plus, for a new
kind of replay, its replay function in the session. Torch-free."""

from __future__ import annotations

from typing import NamedTuple

from ..vocabulary import (
    ACTIVATION,
    BLOCK,
    CLIPPING,
    CORE,
    EXPERT,
    EXPERT_SLOTS,
    EXPERTS,
    LINEAR,
    NORM,
    ROTARY,
    ROUTER,
    SUBLAYER,
)

# hooks
OUTPUT = "output"  # a forward hook on the module: its output is the site's record
INPUT = "input"  # a forward pre-hook: its input is the record (the attention core)
PENDING = "pending"  # a model-level module that runs before the blocks: kept for the round
NO_HOOK = "none"  # recorded by another site's hook (an experts module's slots and experts)
# replays
WHOLE = "module"  # the module re-run on its recorded call, perturbed (probes.run_probes)
ROWS = "rows"  # row-wise: re-run on the probe rows of its input alone
EXPERT_CALLS = "experts"  # each expert through the fused call (moe_capture)
NO_REPLAY = "none"


class RoleCapture(NamedTuple):
    hook: str
    replay: str
    pre_call: bool  # a pre-hook too (the KV cache of a decode step, inputs a fused add
    # overwrites); row-wise operators need none unless they fuse the residual add


ROLE_CAPTURE = {
    BLOCK: RoleCapture(OUTPUT, WHOLE, True),
    SUBLAYER: RoleCapture(OUTPUT, WHOLE, True),
    LINEAR: RoleCapture(OUTPUT, ROWS, False),
    NORM: RoleCapture(OUTPUT, ROWS, False),
    ACTIVATION: RoleCapture(OUTPUT, ROWS, False),
    CLIPPING: RoleCapture(OUTPUT, ROWS, False),
    ROUTER: RoleCapture(OUTPUT, ROWS, False),
    CORE: RoleCapture(INPUT, NO_REPLAY, False),
    # a model-level rotary embedding runs before the blocks: PENDING (role_capture)
    ROTARY: RoleCapture(OUTPUT, WHOLE, True),
    EXPERTS: RoleCapture(OUTPUT, EXPERT_CALLS, True),
    EXPERT_SLOTS: RoleCapture(NO_HOOK, NO_REPLAY, False),
    EXPERT: RoleCapture(NO_HOOK, NO_REPLAY, False),
}


def role_capture(role: str, in_block: bool = True) -> RoleCapture:
    """The row of ``role``; ``in_block`` False for a module outside the blocks (a model-level
    rotary embedding, which runs before them: its output waits for the round)."""
    row = ROLE_CAPTURE[role]
    if not in_block and row.hook == OUTPUT:
        return row._replace(hook=PENDING)
    return row
