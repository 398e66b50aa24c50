"""One captured round as a value: what every record of it shares (the kept positions, the probe
rows, the round's shape and seeds). The session opens one per captured forward and hands it to
the record sink (sinks.py), the replays and the experts capture, instead of itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..format.writer import Round
from .probes import probe_seed


@dataclass
class RoundContext:
    round: Round  # the writer's round: its records accumulate here
    positions: torch.Tensor | None  # kept token positions (None: every position)
    rows: torch.Tensor | None  # probe rows of the flattened kept rows (None: not probed)
    seed: int  # the session's seed (DumpConfig.seed)

    @property
    def sample(self) -> int:
        return self.round.sample

    @property
    def step(self) -> int:
        return self.round.step

    @property
    def phase(self) -> str:
        return "prefill" if self.round.step == 0 else "decode"

    @property
    def probed(self) -> bool:
        return self.rows is not None

    def as_round(self, t: torch.Tensor) -> torch.Tensor:
        """A flattened token list (batch * seq, width), as a router or fused experts module
        gets it, as the round's (batch, seq, width)."""
        r = self.round
        if t.dim() == 2 and r.batch > 1 and t.shape[0] == r.batch * r.seq:
            return t.reshape(r.batch, r.seq, t.shape[-1])
        return t

    def token_shaped(self, t: torch.Tensor) -> bool:
        """(batch, seq, width) of the round, or (seq, width) for a batch of one: a tensor of
        token rows. Experts that see only their routed tokens, per-head outputs (batch, seq,
        heads, dim) and flattened token lists are not."""
        r = self.round
        if t.dim() == 3:
            return tuple(t.shape[:2]) == (r.batch, r.seq)
        return t.dim() == 2 and r.batch == 1 and t.shape[0] == r.seq

    def seeds(self, layer: int, site: int) -> Callable[[int, int], int]:
        """The seed of each (probe kind, probe) of a site this round."""

        def seeds(kind: int, probe: int) -> int:
            return probe_seed(self.seed, self.sample, layer + 1, site + 1, kind, probe)

        return seeds
