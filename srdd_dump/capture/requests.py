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


def engine_batch(tables: bool = True) -> BatchLayout | str | None:
    """The layout of the forward running now, read from vLLM's forward context: None outside
    such an engine, DUMMY for a forward without attention metadata, a reason (str) when the
    metadata does not say where each request starts. ``tables`` False: the requests' starts
    only (no copy of the KV cache's slots and block table to the host)."""
    module = sys.modules.get("vllm.forward_context")
    if module is None or not module.is_forward_context_available():
        return None
    context = module.get_forward_context()
    meta = context.attn_metadata
    if isinstance(meta, list):  # two micro-batches (DBO): not split here
        return None
    if isinstance(meta, dict):
        meta = next(iter(meta.values()), None)
    if meta is None:
        return DUMMY
    starts = getattr(meta, "query_start_loc", None)
    if not isinstance(starts, torch.Tensor):
        return f"{type(meta).__name__} (its attention backend's metadata) has no query_start_loc"
    n_tokens = getattr(meta, "num_actual_tokens", None)
    starts = starts.detach().to("cpu").numpy().astype(np.int64)
    if isinstance(n_tokens, int):
        starts = np.minimum(starts, n_tokens)
    slots, table = ((getattr(meta, "slot_mapping", None), getattr(meta, "block_table", None))
                    if tables else (None, None))
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
    probed: bool = False  # its rows are among the round's probe rows
    stats: list = field(default_factory=list)  # its stats rows (--store stats: sinks.py)

    def kept_rows(self) -> np.ndarray:
        return self.kept if self.kept is not None else np.arange(self.start, self.stop)

    def own(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which of the flat ``rows`` are this request's kept rows, their index among them)."""
        kept = self.kept_rows()
        mine = np.isin(rows, kept)
        return mine, np.searchsorted(kept, rows[mine])


@dataclass
class _Live:
    sample: int
    next_position: int
    last_block: int | None
    step: int = 0
    seen: int = 0  # the forward it was last in


@dataclass
class RequestTracker:
    """Requests across forwards, numbered as samples in the order the engine first ran them.

    An engine runs every running request in each step, so a request continues only from the
    forward just before (one missing from it has finished or was preempted): then its next
    position and the cache block of its last token must match. A call that continues no such
    request is a new request when it holds more than one token (from position 0, or past a
    prefix the engine had cached), else it is not captured and counted (``unmatched``)."""

    live: list[_Live] = field(default_factory=list)
    requests: int = 0  # requests seen
    unmatched: int = 0  # request calls that could not be tied to an earlier call
    forwards: int = 0
    block: int | None = None  # the cache's block size, once inferred

    def split(self, layout: BatchLayout, positions: np.ndarray) -> list[Segment]:
        """The segments of one forward (``positions``: its flat positions tensor)."""
        self.forwards += 1
        self.live = [r for r in self.live if r.seen >= self.forwards - 1]
        block = self.block = _block_size(layout, positions, self.block)
        taken: set[int] = set()
        out = []
        for i in range(layout.n_requests):
            a, b = int(layout.starts[i]), int(layout.starts[i + 1])
            if b <= a:
                continue
            pos = positions[a:b]
            first = int(pos[0])
            req = None if first == 0 else self._match(layout, i, first, block, taken)
            if req is None and (first == 0 or b - a > 1):
                req = _Live(self.requests, first, None)
                self.requests += 1
                self.live.append(req)
                step = 0
            elif req is None:
                self.unmatched += 1
                out.append(Segment(a, b, pos, -1, -1))
                continue
            elif b - a == 1:
                req.step += 1
                step = req.step
            else:  # a later chunk of a prompt split over forwards (chunked prefill)
                step = -1
            taken.add(id(req))
            req.seen = self.forwards
            req.next_position = int(pos[-1]) + 1
            req.last_block = _block_of(layout, i, int(pos[-1]), block)
            out.append(Segment(a, b, pos, req.sample, step))
        return out

    def _match(self, layout: BatchLayout, i: int, first: int, block: int | None,
               taken: set[int]) -> _Live | None:
        """The request of the last forward whose next token is this call's first and whose
        last token lies in the cache block this call's row holds for position ``first - 1``;
        without the cache layout, the only request whose next token it is (None: ambiguous)."""
        candidates = [r for r in self.live if r.next_position == first and id(r) not in taken]
        previous = _block_of(layout, i, first - 1, block)
        if previous is not None:
            exact = [r for r in candidates if r.last_block == previous]
            return exact[0] if len(exact) == 1 else None
        return candidates[0] if len(candidates) == 1 else None


def _block_size(layout: BatchLayout, positions: np.ndarray, known: int | None = None
                ) -> int | None:
    """The cache's block size: the one under which every token's slot is its row's block for
    its position (inferred, as the metadata does not carry it; ``known``, the size found
    before, is tried first)."""
    if layout.slots is None or layout.block_table is None:
        return None
    n = int(layout.starts[-1])
    rows = np.repeat(np.arange(layout.n_requests), np.diff(layout.starts))
    pos, slots = positions[:n], layout.slots[:n]
    # the largest that fits: a smaller one can only fit a table that starts at block 0
    for size in ([known] if known else []) + list(reversed(BLOCK_SIZES)):
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
    if "vllm" in sys.modules and isinstance(positions, torch.Tensor):
        why = layout if isinstance(layout, str) else (
            "vLLM's forward context did not give the batch's requests (query_start_loc)"
            if flat is not None else "the block's positions are not one position per token")
        return None, None, f"{why}: each forward is written as one sample"
    return None, None, None


def flat_positions(value: Any) -> np.ndarray | None:
    """A forward's positions tensor (tokens,) as numpy (multimodal rotary's (3, tokens): its
    first row, the text positions); None when it is not one."""
    if not isinstance(value, torch.Tensor) or value.is_floating_point():
        return None
    if value.dim() == 2 and value.shape[0] <= 4:
        value = value[0]
    if value.dim() == 1:
        return value.detach().to("cpu").numpy().astype(np.int64)
    return None
