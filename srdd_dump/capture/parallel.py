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
* ``--tp-replays lockstep`` replays them anyway, on every rank at the same point: before each
  such replay the ranks agree through the process group's store (``lockstep``), and a rank
  that does not arrive in time (its capture stopped) makes every rank stop those replays for
  good, so the program's own collectives stay paired. Their replays run one
  input at a time with the recorded shapes, so an all-reduce sums every element in the
  recorded order and the exact identities hold. Left: a replay that fails on one rank only
  after it has communicated (out of memory) leaves the others waiting in that collective.
  Never with ``--reference host``: the float64 copy of a sharded module is not the module.
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
import sys
from typing import Any, Callable

import torch
from torch import nn

from .discovery import CORE, LINEAR, ROTARY
from .lockstep import Lockstep

REPLICATED, SHARD, PARTIAL = "replicated", "shard", "partial"
SKIP, LOCKSTEP = "skip", "lockstep"  # --tp-replays


def _dtensor_class() -> type | None:
    """DTensor, when the program has imported it (importing it costs 0.5 s; a program without
    it has no DTensor)."""
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):  # torch >= 2.4, older
        cls = getattr(sys.modules.get(name), "DTensor", None)
        if cls is not None:
            return cls
    return None


def is_dtensor(value: Any) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(value, cls)


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
    try:
        return type(t).from_local(local, t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    except TypeError:  # torch < 2.2: no shape / stride (an uneven shard is then not known)
        return type(t).from_local(local, t.device_mesh, t.placements, run_check=False)


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

    def __init__(self, model: nn.Module, modules: list[nn.Module], replays: str = SKIP):
        self.rank, self.world_size = world()
        self.active = self.world_size > 1 and holds_distributed(model)
        self._distributed = (
            {id(m) for m in modules if holds_distributed(m)} if self.active else set())
        self._lockstep = (Lockstep.start(self.world_size)
                          if self.active and replays == LOCKSTEP else None)
        self.replays_skipped = 0
        self.replays_lockstep = 0
        self.host_replays_skipped = 0
        self.sharded_sites: dict[str, str] = {}
        self._local_widths: set[int] = set()  # widths of column-parallel outputs seen

    def may_replay(self, module: nn.Module) -> bool:
        """False (and counted) for a module whose replay could communicate, unless the ranks
        replay in lockstep and all of them are here."""
        if id(module) not in self._distributed:
            return True
        if self._lockstep is not None and self._lockstep.agree():
            self.replays_lockstep += 1
            return True
        self.replays_skipped += 1
        return False

    def may_host_replay(self, module: nn.Module) -> bool:
        """The float64 host copy of a module with distributed parameters is not that module."""
        if id(module) in self._distributed:
            self.host_replays_skipped += 1
            return False
        return True

    def sharded(self, module: nn.Module) -> bool:
        """The module holds distributed (DTensor) parameters: each rank has a part of them."""
        return id(module) in self._distributed

    def batched(self, module: nn.Module) -> bool:
        """A lockstep replay runs one input at a time with the recorded shapes (the order an
        all-reduce sums an element in depends on its offset in the buffer)."""
        return not self.sharded(module)

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

    def _is_local_part(self, t: torch.Tensor, role: str, module: nn.Module | None,
                       width: int) -> bool:
        """A plain tensor of a site that is this rank's shard: the output of a column-parallel
        linear map (narrower than its ``out_features``), the input of a row-parallel one (the
        attention core, narrower than ``in_features``), or another operator's tensor that is
        not as wide as the hidden state but as wide as a column-parallel output (it sits
        between the two: the MLP's activation). Rotary tables are computed from the position
        ids on every rank: replicated. (FSDP's sharded weights give full outputs: none.)"""
        got = int(t.shape[-1]) if t.dim() else 0
        weight = getattr(module, "weight", None)
        dim = _sharded_dim(weight)
        if role == LINEAR and dim is not None:
            local = dim == 0 and got != getattr(module, "out_features", got)
            if local:
                self._local_widths.add(got)
            return local
        if role == CORE and dim is not None:
            return dim == weight.dim() - 1 and got != getattr(module, "in_features", got)
        if not role or role == ROTARY:
            return False
        return got != width and got in self._local_widths

    def meta(self) -> dict | None:
        """The dump's ``tensor_parallel`` metadata (None when not tensor parallel)."""
        if not self.active:
            return None
        return {"world_size": self.world_size, "rank": self.rank,
                "sharded_sites": dict(self.sharded_sites),
                "replays": LOCKSTEP if self._lockstep is not None else SKIP}

    def status(self) -> dict:
        if not self.active:
            return {}
        out = {"tp_replays_skipped": self.replays_skipped,
               "tp_host_replays_skipped": self.host_replays_skipped}
        if self._lockstep is not None:
            out.update(tp_replays_lockstep=self.replays_lockstep,
                       tp_lockstep_stopped=self._lockstep.stopped)
        return out
