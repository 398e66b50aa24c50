"""A serving engine's flattened batch, split into its requests.

vLLM (and engines built like it) runs every request scheduled in a step as one flat token
tensor ``(num_tokens, hidden)`` with a ``positions`` tensor; the attention metadata in the
engine's forward context says where each request's tokens start (``query_start_loc``), and the
paged KV cache says whose they are (``block_table``: one row of cache blocks per request,
``slot_mapping``: the cache slot each token writes). A request is a sample: its first call
(positions from 0) is its prefill, step 0; each later one-token call is its next decode step.
A forward with no attention metadata is a dummy, profile or warm-up run: never a sample.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

DUMMY = "dummy"  # engine_batch(): a forward of the engine without attention metadata
MAX_LIVE = 4096  # requests remembered (finished ones are not told apart from live ones)
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass
class BatchLayout:
    """One forward's requests: flat token rows [starts[i], starts[i + 1])."""

    starts: np.ndarray  # (requests + 1,) flat row offsets; the last is the real token count
    slots: np.ndarray | None  # (tokens,) the KV cache slot each token writes
    block_table: np.ndarray | None  # (requests, blocks) cache blocks of each request

    @property
    def n_requests(self) -> int:
        return len(self.starts) - 1


def engine_batch() -> BatchLayout | str | None:
    """The layout of the forward running now, read from vLLM's forward context: None outside
    such an engine, DUMMY for a forward without attention metadata."""
    module = sys.modules.get("vllm.forward_context")
    if module is None or not module.is_forward_context_available():
        return None
    context = module.get_forward_context()
    meta = context.attn_metadata
    if isinstance(meta, list):  # two micro-batches (DBO): not split here
        return None
    if isinstance(meta, dict):
        meta = next(iter(meta.values()), None)
    starts = getattr(meta, "query_start_loc", None)
    if not isinstance(starts, torch.Tensor):
        return DUMMY
    n_tokens = getattr(meta, "num_actual_tokens", None)
    starts = starts.detach().to("cpu").numpy().astype(np.int64)
    if isinstance(n_tokens, int):
        starts = np.minimum(starts, n_tokens)
    slots, table = getattr(meta, "slot_mapping", None), getattr(meta, "block_table", None)
    return BatchLayout(
        starts=starts,
        slots=slots.detach().to("cpu").numpy() if isinstance(slots, torch.Tensor) else None,
        block_table=(table.detach().to("cpu").numpy() if isinstance(table, torch.Tensor)
                     else None))


@dataclass
class Segment:
    """One request's tokens in one forward."""

    start: int  # flat rows [start, stop)
    stop: int
    positions: np.ndarray  # the tokens' positions in their request
    sample: int  # the request's number, in the order the engine first ran them (-1: unknown)
    step: int  # 0: its prefill; n: its n-th decode step
    kept: np.ndarray | None = None  # flat rows kept (--tokens within the request)
    stats: list = field(default_factory=list)  # its stats rows (--store stats: sinks.py)

    def kept_rows(self) -> np.ndarray:
        return self.kept if self.kept is not None else np.arange(self.start, self.stop)


@dataclass
class _Live:
    sample: int
    next_position: int
    last_block: int | None
    step: int = 0


@dataclass
class RequestTracker:
    """Requests across forwards, numbered as samples in the order the engine first ran them."""

    live: list[_Live] = field(default_factory=list)
    requests: int = 0  # requests seen
    unmatched: int = 0  # request calls that could not be tied to an earlier call

    def split(self, layout: BatchLayout, positions: np.ndarray) -> list[Segment]:
        """The segments of one forward (``positions``: its flat positions tensor)."""
        block = _block_size(layout, positions)
        taken: set[int] = set()
        out = []
        for i in range(layout.n_requests):
            a, b = int(layout.starts[i]), int(layout.starts[i + 1])
            if b <= a:
                continue
            pos = positions[a:b]
            first = int(pos[0])
            if first == 0:
                req = _Live(self.requests, 0, None)
                self.requests += 1
                self.live.append(req)
                del self.live[:-MAX_LIVE]
                step = 0
            else:
                req = self._match(layout, i, first, block, taken)
                if req is None:
                    self.unmatched += 1
                    out.append(Segment(a, b, pos, -1, -1))
                    continue
                # a later chunk of a prompt split over steps (chunked prefill) is not a step
                req.step += 1 if b - a == 1 else 0
                step = req.step if b - a == 1 else -1
            taken.add(id(req))
            req.next_position = int(pos[-1]) + 1
            req.last_block = _block_of(layout, i, int(pos[-1]), block)
            out.append(Segment(a, b, pos, req.sample, step))
        return out

    def _match(self, layout: BatchLayout, i: int, first: int, block: int | None,
               taken: set[int]) -> _Live | None:
        """The live request whose next token is this call's first: the one whose last token
        lies in the cache block this call's row holds for position ``first - 1``; of two, the
        later (the engine reuses a finished request's blocks)."""
        previous = _block_of(layout, i, first - 1, block)
        candidates = [r for r in reversed(self.live)
                      if r.next_position == first and id(r) not in taken]
        exact = [r for r in candidates if previous is not None and r.last_block == previous]
        found = (exact or candidates or [None])[0]
        return found


def _block_size(layout: BatchLayout, positions: np.ndarray) -> int | None:
    """The cache's block size: the one under which every token's slot is its row's block for
    its position (inferred, as the metadata does not carry it)."""
    if layout.slots is None or layout.block_table is None:
        return None
    n = int(layout.starts[-1])
    rows = np.repeat(np.arange(layout.n_requests), np.diff(layout.starts))
    pos, slots = positions[:n], layout.slots[:n]
    for size in BLOCK_SIZES:
        col = pos // size
        if (col >= layout.block_table.shape[1]).any():
            continue
        if np.array_equal(layout.block_table[rows, col] * size + pos % size, slots):
            return size
    return None


def _block_of(layout: BatchLayout, i: int, position: int, block: int | None) -> int | None:
    if block is None or layout.block_table is None or position < 0:
        return None
    col = position // block
    return int(layout.block_table[i, col]) if col < layout.block_table.shape[1] else None


def read_batch(positions: Any) -> tuple[BatchLayout | str | None, np.ndarray | None,
                                         str | None]:
    """A serving block's forward as (layout, flat positions, why it cannot be split): layout
    DUMMY for an engine's dummy run; (None, None, None) outside an engine; a reason when a vLLM
    block's flat batch has no layout to split it by (a vLLM this code does not know)."""
    layout, flat = engine_batch(), flat_positions(positions)
    if layout == DUMMY:
        return DUMMY, None, None
    if isinstance(layout, BatchLayout) and flat is not None \
            and flat.size >= int(layout.starts[-1]):
        return layout, flat, None
    if "vllm" in sys.modules and flat is not None:
        return None, None, ("vLLM's forward context did not give the batch's requests "
                            "(query_start_loc): each forward is written as one sample")
    return None, None, None


def flat_positions(value: Any) -> np.ndarray | None:
    """A forward's positions tensor (tokens,) as numpy; None when it is not one."""
    if isinstance(value, torch.Tensor) and value.dim() == 1 and not value.is_floating_point():
        return value.detach().to("cpu").numpy().astype(np.int64)
    return None
