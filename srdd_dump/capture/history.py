"""The input ids of every forward of a sample, captured or not, as one running hash: a decode
round's inputs agree with another run's only when every token before it does (the KV cache
holds them all), also those of the steps neither dump captured (``--steps 0-2,7`` leaves 3-6
out: two generations can part there and meet again on one token at step 7).

The hash is blake2b (8 bytes) over the little-endian int64 ids of the sample's forwards in
order, each forward's (batch, seq) ids row by row: the same whichever steps were captured. The
ids stay on the device until a captured round (or every FOLD forwards) needs the hash: no
extra host sync per decode step.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

FOLD = 64  # forwards whose ids wait on the device before they are hashed


class TokenHistory:
    """The running hash of the current sample's input ids; ``known``: (sample, step) -> the
    hash up to and including that captured round, for the rounds whose every forward's ids
    were seen (format: the file status's ``histories``)."""

    def __init__(self) -> None:
        self._hash: hashlib.blake2b | None = None  # None: a forward without visible ids
        self._pending: list[torch.Tensor] = []
        self.known: dict[tuple[int, int], int] = {}

    def start(self) -> None:
        """A new sample: its prefill comes next."""
        self._hash, self._pending = hashlib.blake2b(digest_size=8), []

    def add(self, ids: torch.Tensor | None) -> None:
        """One forward's input ids (None: not visible, so the history is unknown from here)."""
        if self._hash is None:
            return
        if ids is None:
            self._hash, self._pending = None, []
            return
        try:
            # a copy: a program may refill one buffer of ids in place at each step
            self._pending.append(ids.detach().reshape(-1).clone())
            if len(self._pending) >= FOLD:
                self._fold()
        except Exception:  # noqa: BLE001 (ids of an odd kind: the history is unknown, no more)
            self._hash, self._pending = None, []

    def record(self, sample: int, step: int) -> None:
        """The history up to this captured round."""
        try:
            self._fold()
        except Exception:  # noqa: BLE001 (as in add)
            self._hash, self._pending = None, []
        if self._hash is not None:
            self.known[(sample, step)] = int.from_bytes(self._hash.copy().digest(), "little")

    def mark(self) -> tuple:
        return (None if self._hash is None else self._hash.copy()), list(self._pending)

    def undo(self, mark: tuple) -> None:
        """Back to ``mark``: the forward since raised and counts as none."""
        self._hash, self._pending = mark[0], list(mark[1])

    def as_list(self) -> list[list[int]]:
        return [[sample, step, h] for (sample, step), h in sorted(self.known.items())]

    def _fold(self) -> None:
        if self._pending and self._hash is not None:
            # one copy to the host, or one per device where the forwards' ids were on several
            one = len({t.device for t in self._pending}) == 1
            for ids in [torch.cat(self._pending)] if one else self._pending:
                host = ids.to("cpu", torch.int64).numpy()
                self._hash.update(np.ascontiguousarray(host, dtype="<i8").tobytes())
        self._pending = []
