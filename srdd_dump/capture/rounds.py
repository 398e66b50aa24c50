"""One captured round as a value: what every record of it shares (the kept positions, the probe
rows, the round's shape and seeds). The session opens one per captured forward and hands it to
the record sink (sinks.py), the replays and the experts capture, instead of itself."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..format import schema
from ..format.writer import Round
from . import config as cfg
from .config import DumpConfig
from .probes import probe_seed
from .requests import BatchLayout, RequestTracker
from .tensors import kept


@dataclass
class RoundContext:
    round: Round  # the writer's round: its records accumulate here
    positions: torch.Tensor | None  # kept token positions (None: every position)
    rows: torch.Tensor | None  # probe rows of the flattened kept rows (None: not probed)
    seed: int  # the session's seed (DumpConfig.seed)
    keep: np.ndarray | None = None  # (batch, kept positions), False at padding; None: all
    # a serving engine's flat batch: the requests' segments kept, each a round of its own
    # (split_round); None for a (batch, seq) forward
    segments: list | None = None
    # the model call's 2-D attention mask (batch, past + seq), nonzero where a key is attended;
    # None when the call had none (the reference attention builds its mask from it)
    key_mask: torch.Tensor | None = None
    mask_unread: bool = False  # the call's mask was not a 2-D tensor: its padding is unknown

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
    def probed_phase(self) -> str:
        """The phase the round's probes count under: a serving engine's forward may run a
        probed request's decode step beside other requests' prefills (vLLM adds requests one
        by one), whose probes are decode evidence."""
        probed = [s for s in self.segments or () if s.probed]
        if not probed:
            return self.phase
        # a probed prefill among them: the forward is replayed as a prefill
        return "decode" if all(s.step > 0 for s in probed) else "prefill"

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

    def probe_rows(self, t: torch.Tensor) -> torch.Tensor:
        """The round's probe rows of a tensor of its tokens, as they are stored (1, rows,
        width); a copy where rows are picked, else a view."""
        return kept(self.as_round(t), self.positions, self.rows)

    def token_shaped(self, t: torch.Tensor) -> bool:
        """(batch, seq, width) of the round, or (seq, width) for a batch of one: a tensor of
        token rows. Experts that see only their routed tokens, per-head outputs (batch, seq,
        heads, dim) and flattened token lists are not."""
        r = self.round
        if t.dim() == 3:
            return tuple(t.shape[:2]) == (r.batch, r.seq)
        return t.dim() == 2 and r.batch == 1 and t.shape[0] == r.seq

    def round_shaped(self, t: torch.Tensor) -> torch.Tensor | None:
        """A model-level table (batch 1 or the round's, the round's tokens) as the round's
        (batch, seq, width): a batch-1 table (position ids shared by the batch) is repeated, as
        every record of a round has its shape (docs/dump-format.md). None: another shape."""
        r = self.round
        if t.dim() != 3 or t.shape[1] != r.seq or t.shape[0] not in (1, r.batch):
            return None
        return t.expand(r.batch, -1, -1) if t.shape[0] != r.batch else t

    def seeds(self, layer: int, site: int) -> Callable[[int, int], int]:
        """The seed of each (probe kind, probe) of a site this round."""

        def seeds(kind: int, probe: int) -> int:
            return probe_seed(self.seed, self.sample, layer + 1, site + 1, kind, probe)

        return seeds


class RoundPlanner:
    """Which forwards of the model become captured rounds, and their rows. A forward of more
    than one token starts a sample (its prefill, step 0); a one-token forward is the next decode
    step of the current sample. The options pick the samples, steps and token positions kept,
    and which of those rounds are probed (and on which rows): each probed step in the first
    ``probe_samples`` samples that reach it, so a short first sample (a warm-up call, an early
    end of sequence) passes the decode steps it never ran on to the next."""

    DONE = "done"  # open_requests: the requests asked for are all captured

    def __init__(self, config: DumpConfig, probing: bool):
        self.config, self.options = config, config.parsed()
        self.probing = probing  # probes or host replays asked for
        self.sample, self.step = -1, 0
        self.continued = False  # the current sample began after a cached past
        self.unprobed_continuation = False  # its prefill would have been probed: it was not
        self.probed: dict[int, set[int]] = {}  # step -> the samples in which it was probed
        self.requests = RequestTracker()  # a serving engine's requests
        self.no_kept_position = 0  # the longest forward --tokens kept no position of
        self.last_step_seen = -1  # the largest step of any sample seen
        self.step_opened = False  # a forward of a selected step (--steps) was seen
        # request calls within --samples, each captured (None) or why not (coverage: the
        # session counts them in the "request samples" family)
        self.request_calls: list[str | None] = []

    def mark(self) -> tuple[int, int, bool]:
        """The plan as it stands before a model call (``undo`` returns to it)."""
        return self.sample, self.step, self.continued

    def undo(self, mark: tuple[int, int, bool]) -> None:
        """A model call that raised before its round was finished counts as no forward: its
        sample or step, and the probes it took, go to the next forward. (Each forward is a
        new (sample, step): the probes of the one it opened are its own.)"""
        if mark[:2] != (self.sample, self.step):
            self.probed.get(self.step, set()).discard(self.sample)
        self.sample, self.step, self.continued = mark
        self.unprobed_continuation = False

    @property
    def samples_seen(self) -> int:
        """Prefill forwards, or a serving engine's requests up to --samples."""
        return max(self.sample + 1, min(self.requests.requests, self.config.samples))

    def advance(self, seq: int, starts: bool = False, continues: bool = False) -> bool:
        """Count a forward of ``seq`` tokens (``starts``: its KV cache holds no earlier tokens,
        a one-token prompt; ``continues``: several tokens after a cached past, a later chat
        turn or a speculative verification, a sample captured without probes); False once
        everything asked for is captured."""
        self.unprobed_continuation = False
        if seq > 1 or starts:
            self.sample, self.step = self.sample + 1, 0
            self.continued = continues and seq > 1
        elif self.sample >= 0:
            self.step += 1
        samples = self.config.samples
        return not (self.sample >= samples
                    or (self.sample == samples - 1 and self.step > self.options.last_step))

    def open(self, batch: int, seq: int, width: int, token_ids: torch.Tensor | None,
             mask: torch.Tensor | None, sample_rows: Callable) -> RoundContext | None:
        """The context of this forward's round; None when it is not captured. ``mask``: the
        model call's 2-D attention mask; ``sample_rows``: the sink's ``round_rows``."""
        if self.sample < 0:
            return None
        self.last_step_seen = max(self.last_step_seen, self.step)
        if not cfg.step_selected(self.options.steps, self.step):
            return None
        self.step_opened = True
        positions = cfg.token_positions(self.options.tokens, seq)
        if not positions:
            self.no_kept_position = max(self.no_kept_position, seq)
            return None
        ids = None
        if token_ids is not None and token_ids.shape[-1] == seq:
            ids = token_ids.detach().to("cpu").reshape(batch, seq).numpy()
        keep = attended_rows(mask, batch, seq, positions)
        rows = None
        if self._probes(self.sample, self.step, seq):
            rows = probe_rows(batch, len(positions), width, keep, self.options.store.elements,
                              probe_seed(self.config.seed, self.sample, 0x5EED))
        return RoundContext(
            round=Round(
                sample=self.sample, step=self.step, batch=batch, seq=seq,
                positions=np.asarray(positions), token_ids=ids, time=time.time(),
                probe_rows=sample_rows(rows, keep, batch, len(positions), self.sample,
                                       self.step)),
            positions=(None if len(positions) == seq
                       else torch.tensor(positions, dtype=torch.long)),
            rows=None if rows is None else torch.from_numpy(rows.astype(np.int64)),
            seed=self.config.seed, keep=keep, key_mask=mask,
        )

    def _probes(self, sample: int, step: int, tokens: int) -> bool:
        """Whether step ``step`` of ``sample`` (a call of ``tokens`` tokens) is probed: a probed
        step (``--probe-steps``) not yet probed in ``--probe-samples`` other samples (counted
        here). A prefill of one token (a warm-up call) does not take the prefill's probes: its
        one row is a decode step's shape, and the prefill's statistics need rows. Nor does a
        prefill after a cached past: its replay would need that past."""
        if not self.probing or not cfg.step_selected(self.options.probe_steps, step):
            return False
        if step == 0 and tokens < 2:
            return False
        samples = self.probed.setdefault(step, set())
        if sample not in samples and len(samples) >= self.config.probe_samples:
            return False
        if step == 0 and self.continued:
            self.unprobed_continuation = True
            return False
        samples.add(sample)
        return True

    def open_requests(self, layout: BatchLayout, positions: np.ndarray, n_tokens: int,
                      width: int, token_ids: torch.Tensor | None, sample_rows: Callable
                      ) -> RoundContext | str | None:
        """The context of a serving engine's flat forward, split into its requests (one
        requests.Segment each): captured when one of its requests is a sample and step the
        options select; its probe rows are the first token of every probed request and seeded
        others of those requests. DONE once the first --samples requests are past."""
        opts, config = self.options, self.config
        segments = self.requests.split(layout, positions)
        if self.requests.requests >= config.samples and all(
                s.sample < 0 or s.sample >= config.samples for s in segments):
            return self.DONE
        for s in segments:
            if s.sample < 0:
                self.request_calls.append(
                    "a call that continues no request seen (a request begun before capture)")
            elif s.sample < config.samples:
                self.request_calls.append(None if s.step >= 0 else (
                    "a prompt split over forwards (chunked prefill): its later chunks are "
                    "not captured"))
        chosen = []
        for s in segments:
            if 0 <= s.sample < config.samples and s.step >= 0 \
                    and cfg.step_selected(opts.steps, s.step):
                kept = cfg.token_positions(opts.tokens, s.stop - s.start)
                if kept:
                    s.kept = s.start + np.asarray(kept, dtype=np.int64)
                    chosen.append(s)
        if not chosen:
            return None
        probed = [s for s in chosen if self._probes(s.sample, s.step, s.stop - s.start)]
        rows = None
        for s in probed:
            s.probed = True
        if probed:  # among the kept rows of the probed requests
            firsts = np.array([s.kept[0] for s in probed])
            budget = (n_tokens if opts.store.elements is None
                      else max(len(firsts), -(-opts.store.elements // max(1, width))))
            rest = np.setdiff1d(np.concatenate([s.kept for s in probed]), firsts)
            rng = np.random.default_rng(probe_seed(config.seed, probed[0].sample, 0x5EED))
            extra = rng.choice(rest, size=min(rest.size, budget - len(firsts)), replace=False)
            rows = np.sort(np.concatenate([firsts, extra])).astype(np.int64)
        ids = None
        if token_ids is not None and token_ids.numel() == n_tokens:
            ids = token_ids.detach().to("cpu").reshape(1, n_tokens).numpy()
        # a forward holding a prefill is replayed as one (its causality probe runs)
        lead = min(chosen, key=lambda s: s.step)
        return RoundContext(
            round=Round(sample=lead.sample, step=lead.step, batch=1, seq=n_tokens,
                        positions=np.arange(n_tokens), token_ids=ids, time=time.time(),
                        probe_rows=_rows_per_request(chosen, rows, sample_rows)),
            positions=None,
            rows=None if rows is None else torch.from_numpy(rows),
            seed=config.seed, segments=chosen,
        )


def _rows_per_request(segments: list, rows: np.ndarray | None, sample_rows: Callable
                      ) -> np.ndarray | None:
    """The rows a flat round's row-subset records hold (``Round.probe_rows``), chosen by the
    sink for each request over its own kept rows, as that request alone would have them."""
    parts = []
    for s in segments:
        mine = None
        if rows is not None:
            mine = s.own(rows)[1]
            mine = mine if mine.size else None
        local = sample_rows(mine, None, 1, len(s.kept), s.sample, s.step)
        if local is not None and len(local):
            parts.append(s.kept[np.asarray(local, dtype=np.int64)])
    return np.sort(np.concatenate(parts)) if parts else None


def split_round(r: Round, segments: list) -> list[Round]:
    """A serving engine's flat forward as one round per request segment: its rows of every
    record (its kept rows: --tokens applied per request), its real positions and token ids,
    its probe rows renumbered within it, and its stats rows (the sink reduced each request
    apart)."""
    out = []
    rows = r.probe_rows
    for seg in segments:
        flat = seg.kept_rows()
        keep = flat - seg.start
        mine, local = seg.own(rows) if rows is not None else (None, None)
        part = Round(sample=seg.sample, step=seg.step, batch=1, seq=seg.stop - seg.start,
                     positions=np.asarray(seg.positions)[keep],
                     token_ids=None if r.token_ids is None else r.token_ids[:, flat],
                     probe_rows=None if local is None or local.size == 0 else local,
                     time=r.time, stats=list(seg.stats))
        for t in r.tensors:
            if not t.subset:
                part.tensors.append(dataclasses.replace(t, array=t.array[:, flat]))
            elif part.probe_rows is not None:
                param = local_param(t.kind, t.param, seg)
                if param is not None:  # (None: a causality record of another request's cut)
                    part.tensors.append(dataclasses.replace(t, array=t.array[:, mine],
                                                            param=param))
        out.append(part)
    return out


def local_param(kind: int, param: float, seg) -> float | None:
    """A record's param within one request: a causality probe's cut (a flat row of the batch)
    as that request's position; None for a causality record of a request the cut is not in
    (it was not perturbed: its copy would test nothing)."""
    if kind != schema.KIND_CAUSAL:
        return param
    cut = int(param)
    if seg.start <= cut < seg.stop:
        return float(seg.positions[cut - seg.start])
    return None


def attended_rows(mask: torch.Tensor | None, batch: int, seq: int, positions: list[int]
                  ) -> np.ndarray | None:
    """(batch, kept positions): False where the model call's 2-D attention mask excludes the
    row (padding); None when every kept row is attended (or the mask is not the round's)."""
    if mask is None or mask.shape[0] != batch or mask.shape[-1] < seq:
        return None
    keep = (mask[:, -seq:].detach().to("cpu")[:, positions] != 0).numpy()
    return None if keep.all() else keep


def probe_rows(batch: int, ntok: int, width: int, keep: np.ndarray | None,
               elements: int | None, seed: int) -> np.ndarray:
    """The rows of a round kept for its probe records (about ``elements`` values; None:
    every row): the first attended token of every sequence, where attention-sink tokens carry
    the largest activations (and range faults act first), and seeded-random other attended
    rows (``keep``: the attention mask's rows; padding is never chosen while attended rows
    are left). A decode step (one token per sequence) is probed whole this way too."""
    n_rows = batch * ntok
    if elements is None:
        return np.arange(n_rows)
    k = min(n_rows, -(-elements // max(1, width)))
    attended = np.ones(n_rows, dtype=bool) if keep is None else keep.reshape(-1)
    starts = np.arange(batch) * ntok
    offset = np.argmax(attended.reshape(batch, ntok), axis=1)  # first attended row
    first = (starts + offset)[attended.reshape(batch, ntok).any(axis=1)]
    rest = np.setdiff1d(np.arange(n_rows), first)
    rest = np.concatenate([rest[attended[rest]], rest[~attended[rest]]])  # padding last
    rng = np.random.default_rng(seed)
    n_extra = max(0, k - min(k, first.size))
    n_live = int(attended[rest].sum())
    live = rng.choice(rest[:n_live], size=min(n_extra, n_live), replace=False)
    pad = rest[n_live:][: n_extra - live.size]
    return np.sort(np.concatenate([first[:k], live, pad]))


def drop_misshapen(r: Round) -> int:
    """Every record of a round has the round's shape (readers reject a file otherwise): an
    output of another shape (a module called on other rows) is left out. Returns how many."""
    ntok = len(r.positions)
    rows = None if r.probe_rows is None else len(r.probe_rows)
    keep = [t for t in r.tensors
            if t.array.ndim == 3 and t.array.shape[:2] == ((1, rows) if t.subset
                                                           else (r.batch, ntok))]
    dropped, r.tensors = len(r.tensors) - len(keep), keep
    return dropped
