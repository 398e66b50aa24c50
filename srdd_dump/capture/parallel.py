"""Tensor parallelism seen from capture: ``torchrun`` with DTensor parameters (transformers'
``tp_plan``, torch's ``parallelize_module``, FSDP2).

Every rank runs the same hooks, but capture itself never issues a collective:

* A replay (probe or ``--reference host``) of a module that holds distributed (DTensor)
  parameters would run that module's collectives (the all-reduce of a row-wise projection, the
  all-gather of FSDP) from inside a hook. The ranks do replay in lockstep while capture runs
  the same way on all of them, but nothing guarantees it: a rank whose capture stops (a full
  disk, a file-size limit, an error) would leave the others' replay collectives unmatched, so
  the program hangs, or a replay's all-reduce is paired with one of the program's and its
  result is silently wrong. And an all-reduce is not row-local: the summation order of an
  element depends on its offset in the buffer (gloo and NCCL split it into chunks), so a
  batched replay of stacked copies does not reproduce the recorded output bit for bit and the
  exact identities (causality, batch independence) would report faults that are not there. So
  under tensor parallelism those modules are not replayed (counted: ``replays_skipped``);
  modules without distributed parameters (norms, activations, rotary tables) still are.
* A DTensor output is recorded as its local tensor (``to_local``: no communication). A
  replicated one is the full tensor; a Shard or Partial one is this rank's part, and a plain
  tensor that is a local shard (transformers returns the column-parallel projections'
  outputs, and everything between them and the row-parallel ones, as plain local tensors)
  too. Those sites are listed in the dump's metadata (``tensor_parallel.sharded_sites``,
  site name -> "shard" or "partial"); the compare leaves sharded block outputs out of the
  multi-card check, as ranks hold different parts by design.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn

from .discovery import CORE, LINEAR, ROTARY

REPLICATED, SHARD, PARTIAL = "replicated", "shard", "partial"


def _dtensor_class() -> type | None:
    for where in ("torch.distributed.tensor", "torch.distributed._tensor"):  # torch >= 2.4, older
        try:
            module = __import__(where, fromlist=["DTensor"])
            return module.DTensor
        except Exception:  # noqa: BLE001 (no distributed support in this build)
            continue
    return None


_DTENSOR = _dtensor_class()


def is_dtensor(value: Any) -> bool:
    return _DTENSOR is not None and isinstance(value, _DTENSOR)


def layout(t: torch.Tensor) -> str:
    """replicated, shard or partial: how a DTensor is laid out over its mesh (a plain tensor:
    replicated)."""
    if not is_dtensor(t):
        return REPLICATED
    placements = t.placements
    if any(getattr(p, "is_partial", lambda: False)() for p in placements):
        return PARTIAL
    if any(getattr(p, "is_shard", lambda: False)() for p in placements):
        return SHARD
    return REPLICATED


def to_local(t: Any) -> Any:
    """The local tensor of a DTensor (no communication); anything else unchanged."""
    return t.to_local() if is_dtensor(t) else t


def map_local(t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn`` applied to this rank's local tensor, rewrapped as a DTensor of the same layout:
    statistics inside ``fn`` never start a collective (which one rank alone would wait on)."""
    if not is_dtensor(t):
        return fn(t)
    local = fn(t.to_local())
    return type(t).from_local(local, t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=t.stride())


def env_rank() -> int:
    """This process's global rank as the launcher set it (RANK, else LOCAL_RANK; 0 alone)."""
    value = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    try:
        return int(value or 0)
    except ValueError:
        return 0


def world() -> tuple[int, int]:
    """(rank, world size) of torch.distributed when it is initialised, else of the launcher's
    environment."""
    dist = getattr(torch, "distributed", None)
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001
        pass
    try:
        size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        size = 1
    return env_rank(), size


def holds_distributed(module: nn.Module) -> bool:
    """The module (or a child) has DTensor parameters: running it may communicate."""
    return any(is_dtensor(p) for p in module.parameters())


def _sharded_dim(weight: Any) -> int | None:
    if not is_dtensor(weight):
        return None
    for p in weight.placements:
        if getattr(p, "is_shard", lambda: False)():
            return p.dim % max(1, weight.dim())
    return None


class TensorParallel:
    """The tensor-parallel facts of one capture session; inactive (every method a no-op) unless
    the world has more than one rank and the model holds DTensor parameters."""

    def __init__(self, model: nn.Module, modules: list[nn.Module]):
        self.rank, self.world_size = world()
        self.active = self.world_size > 1 and holds_distributed(model)
        self._distributed = (
            {id(m) for m in modules if holds_distributed(m)} if self.active else set())
        self.replays_skipped = 0
        self.sharded_sites: dict[str, str] = {}

    def may_replay(self, module: nn.Module) -> bool:
        """False (and counted) for a module whose replay could communicate."""
        if id(module) in self._distributed:
            self.replays_skipped += 1
            return False
        return True

    def local(self, t: torch.Tensor, name: str, role: str = "", module: nn.Module | None = None,
              width: int = 0) -> torch.Tensor:
        """The tensor to record for site ``name``: a DTensor's local tensor; a site whose
        tensor is this rank's part only is noted in ``sharded_sites``."""
        if not self.active and not is_dtensor(t):
            return t
        kind = layout(t)
        t = to_local(t)
        if kind == REPLICATED and self.active and self._is_local_part(t, role, module, width):
            kind = SHARD
        if kind != REPLICATED:
            self.sharded_sites[name] = kind
        return t

    @staticmethod
    def _is_local_part(t: torch.Tensor, role: str, module: nn.Module | None, width: int) -> bool:
        """A plain tensor of a site that is this rank's shard: the output of a column-parallel
        linear map (narrower than its ``out_features``), the input of a row-parallel one (the
        attention core, narrower than ``in_features``), or any other operator's tensor of
        another width than the hidden state's (it sits between the two). Rotary tables are
        computed from the position ids on every rank: replicated."""
        got = int(t.shape[-1]) if t.dim() else 0
        weight = getattr(module, "weight", None)
        dim = _sharded_dim(weight)
        if role == LINEAR and dim is not None:
            return dim == 0 and got != getattr(module, "out_features", got)
        if role == CORE and dim is not None:
            return dim == weight.dim() - 1 and got != getattr(module, "in_features", got)
        if not role or role == ROTARY:
            return False
        return bool(width) and got != width

    def meta(self) -> dict | None:
        """The dump's ``tensor_parallel`` metadata (None when not tensor parallel)."""
        if not self.active:
            return None
        return {"world_size": self.world_size, "rank": self.rank,
                "sharded_sites": dict(self.sharded_sites),
                "replays": "skipped for modules with distributed parameters"}

    def status(self) -> dict:
        return {"tp_replays_skipped": self.replays_skipped} if self.active else {}
