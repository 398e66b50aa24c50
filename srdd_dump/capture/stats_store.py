"""``--store stats``: each site's clean output and probe outputs stay on the device until the
site's hook is done, and are then reduced to one row of the dump's stats table
(capture/reductions.py). Nothing but that row leaves the device, and the seeded row sample of
the block outputs that the capture session stores for the baseline mode."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..format import schema as s
from ..format.writer import StatRow
from .reductions import ProbeRows, reduce_round


class StatsCollector:
    """The pending tensors of the sites of one round, reduced site by site."""

    def __init__(self, columns: list[str]):
        self.columns = columns
        self._index = {name: i for i, name in enumerate(columns)}
        self._clean: dict[tuple[int, int], tuple[torch.Tensor, str, torch.Tensor | None]] = {}
        self._probes: dict[tuple[int, int], list[ProbeRows]] = {}
        self._extra: dict[tuple[int, int], dict[str, float]] = {}
        self._previous: tuple[int, torch.Tensor] | None = None  # the last block output reduced
        self._valid: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None
        self._ids: torch.Tensor | None = None
        self.seconds = 0.0  # spent reducing (recorded in the dump's status)

    def open_round(self, valid: np.ndarray | None, positions: np.ndarray, batch: int,
                   rows: torch.Tensor | None, ids: np.ndarray | None = None) -> None:
        """A new round: ``valid`` (batch, ntok) False at padding, None when every row counts;
        ``positions`` the kept token positions; ``rows`` the probe rows (None: not probed);
        ``ids`` the token id of each row (batch, ntok), None where unknown."""
        self._clean.clear()
        self._probes.clear()
        self._extra.clear()
        self._previous = None
        self._valid = None if valid is None else torch.from_numpy(valid.reshape(-1).copy())
        self._positions = torch.from_numpy(np.tile(np.asarray(positions, np.int64), batch))
        self._rows = rows
        n_rows = batch * len(positions)
        self._ids = None if ids is None or ids.size != n_rows else \
            torch.from_numpy(np.asarray(ids, np.int64).reshape(-1).copy())

    def clean(self, layer: int, site: int, kept: torch.Tensor, dtype: str,
              valid: torch.Tensor | None = None) -> None:
        """``valid``: the rows of the round this site has (an expert: the tokens routed to
        it), on top of the round's own mask."""
        self._clean[(layer, site)] = (kept, dtype, valid)

    def hold(self, layer: int, site: int) -> None:
        """The site's clean output as a copy (its row is reduced later, and the model may
        change the tensor in place meanwhile)."""
        entry = self._clean.get((layer, site))
        if entry is not None:
            self._clean[(layer, site)] = (entry[0].clone(), *entry[1:])

    def round_valid(self) -> torch.Tensor | None:
        """The round's kept rows (False at padding); None when every row counts."""
        return self._valid

    def extra(self, layer: int, site: int, values: dict[str, float]) -> None:
        """Columns of the site's row computed elsewhere (an expert's router margin)."""
        self._extra[(layer, site)] = values

    def probe(self, layer: int, site: int, p: ProbeRows) -> None:
        self._probes.setdefault((layer, site), []).append(p)

    def finish(self, layer: int, site: int) -> StatRow | None:
        """The site's row of the stats table (None when it has no clean output this round)."""
        probes = self._probes.pop((layer, site), [])
        found = self._clean.pop((layer, site), None)
        if found is None:
            return None
        x, dtype, site_valid = found
        valid = self._valid
        if site_valid is not None:
            site_valid = site_valid.reshape(-1).to("cpu")
            valid = site_valid if valid is None else valid & site_valid
        before = None
        if site == s.BLOCK_SITE and self._previous is not None \
                and self._previous[0] == layer - 1:
            before = self._previous[1]
        start = time.perf_counter()
        with torch.inference_mode():  # no autograd bookkeeping: less overhead per torch call
            values = reduce_round(x, dtype, before, self._rows, probes, valid,
                                  self._positions, self._ids)
        if site == s.BLOCK_SITE:
            # the next block's update is taken against this output: a copy, since the model
            # may change its tensors in place (a fused residual add)
            self._previous = (layer, x.detach().clone())
        self.seconds += time.perf_counter() - start
        extra = self._extra.pop((layer, site), {})
        if values is None:
            return None
        values.update(extra)
        row = np.full(len(self.columns), np.nan)
        for name, value in values.items():
            at = self._index.get(name)
            if at is not None:
                row[at] = value
        code = s.DTYPE_CODES.index(dtype) if dtype in s.DTYPE_CODES else 0
        return StatRow(layer=layer, site=site, dtype=code, values=row)
