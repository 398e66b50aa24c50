"""The agreement behind ``--tp-replays lockstep``: before each replay of a tensor-parallel
module, every rank must be there, or none replays.

The ranks meet in the process group's store (TCPStore), never in a collective, so a rank
that does not come (its capture stopped) cannot unpair the program's own collectives: the
others wait ``SRDD_DUMP_TP_TIMEOUT`` seconds (default 120), decide "abandon", and from then on
skip those replays. One decision per replay is stored with ``compare_set``: the first one
written wins, so a rank arriving after the others gave up reads "abandon" too.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch

TIMEOUT = 120.0  # seconds a rank waits for the others before a lockstep replay
ENV_TIMEOUT = "SRDD_DUMP_TP_TIMEOUT"  # overrides it
_GO, _ABANDON = "go", "abandon"


def agree(store: Any, key: str, world_size: int, timeout: float) -> bool:
    """Whether every rank reached ``key`` (each rank calls this once per key): the last to
    arrive decides "go"; a rank that waits ``timeout`` seconds decides "abandon". The first
    decision stored wins, so every rank, late ones included, gets the same answer."""
    decision = key + "/decision"
    if int(store.add(key, 1)) >= world_size:
        return _is_go(store.compare_set(decision, "", _GO))
    try:
        store.wait([decision], timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 (DistStoreError: the wait timed out)
        return _is_go(store.compare_set(decision, "", _ABANDON))
    return _is_go(store.get(decision))


def _is_go(value: Any) -> bool:
    return (value.decode() if isinstance(value, bytes) else str(value)) == _GO


def timeout() -> float:
    """``SRDD_DUMP_TP_TIMEOUT`` in seconds, or the default."""
    try:
        value = float(os.environ.get(ENV_TIMEOUT, "") or TIMEOUT)
    except ValueError:
        return TIMEOUT
    return value if value > 0 else TIMEOUT


class Lockstep:
    """The agreements of one capture session, numbered alike on every rank."""

    def __init__(self, store: Any, world_size: int):
        self.store, self.world_size = store, world_size
        self.timeout = timeout()
        self.count = 0
        self.stopped = ""  # why the ranks stopped replaying in lockstep ("" while they do)

    @classmethod
    def start(cls, world_size: int) -> Lockstep | None:
        """On the default process group's store; None without one."""
        try:
            store = torch.distributed.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 (not initialised, or a torch without it)
            return None
        return cls(store, world_size)

    def agree(self) -> bool:
        """True when every rank is at this replay; False from the first miss on."""
        if self.stopped:
            return False
        n, self.count = self.count, self.count + 1
        try:
            if agree(self.store, f"srdd_dump/tp_replay/{n}", self.world_size, self.timeout):
                return True
            self.stopped = f"not every rank reached replay {n} within {self.timeout:g} s"
        except Exception as exc:  # noqa: BLE001 (the store went away)
            self.stopped = f"{type(exc).__name__}: {exc}"
        return False
