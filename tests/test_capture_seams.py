"""The capture side's seams on plain tensors and modules, without a model or a session: the round
planner and its context (rounds.py), the record sinks (sinks.py), the role table (roles.py) and
the replays it drives (replays.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from srdd_dump import vocabulary
from srdd_dump.capture import roles
from srdd_dump.capture.config import DumpConfig
from srdd_dump.capture.discovery import Site
from srdd_dump.capture.parallel import TensorParallel
from srdd_dump.capture.probes import ProbeSpec
from srdd_dump.capture.replays import Replays
from srdd_dump.capture.rounds import RoundContext, RoundPlanner, drop_misshapen, probe_rows
from srdd_dump.capture.sinks import RecordSink, StatsSink, TensorSink, make_sink
from srdd_dump.errors import UserError
from srdd_dump.format import schema
from srdd_dump.format.coverage import Coverage
from srdd_dump.format.writer import Round, Tensor

pytestmark = pytest.mark.capture

WIDTH = 8


def _context(batch=2, seq=5, rows=None, positions=None, keep=None) -> RoundContext:
    kept_positions = list(range(seq)) if positions is None else positions
    return RoundContext(
        round=Round(sample=0, step=0, batch=batch, seq=seq,
                    positions=np.asarray(kept_positions), token_ids=None, time=0.0,
                    probe_rows=None if rows is None else np.asarray(rows)),
        positions=None if positions is None else torch.tensor(positions),
        rows=None if rows is None else torch.tensor(rows),
        seed=0, keep=keep)


# -- rounds ----------------------------------------------------------------------------------
def test_the_planner_counts_samples_and_decode_steps_and_stops_when_done():
    planner = RoundPlanner(DumpConfig(samples=2, steps="0,1"), probing=True)
    seen = []
    for seq in (6, 1, 1, 4, 1):
        assert planner.advance(seq)
        seen.append((planner.sample, planner.step))
    assert seen == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert not planner.advance(1)  # sample 1, step 2: past the last step asked for


def test_the_planner_opens_only_the_rounds_the_options_select():
    planner = RoundPlanner(DumpConfig(samples=3, steps="0,2", probe_steps="0",
                                      probe_samples=1, tokens="0,-1"), probing=True)
    contexts = []
    for seq in (5, 1, 1, 7):
        planner.advance(seq)
        contexts.append(planner.open(1, seq, WIDTH, None, None, RecordSink().round_rows))
    prefill, step1, step2, second = contexts
    assert step1 is None  # step 1 is not in --steps
    assert prefill.probed and not step2.probed and not second.probed  # probe-steps 0, 1 sample
    assert prefill.round.positions.tolist() == [0, 4] and second.round.positions.tolist() == [0, 6]
    assert prefill.positions.tolist() == [0, 4]
    assert step2.positions is None  # one token: every position kept


def test_by_default_the_first_samples_prefill_and_decode_step_1_are_probed_and_7_captured():
    planner = RoundPlanner(DumpConfig(), probing=True)  # --steps 0-2,7, --probe-steps 0,1
    captured, probed = [], []
    for seq in (5, 1, 1, 1, 1, 1, 1, 1, 6, 1, 1):
        planner.advance(seq)
        ctx = planner.open(1, seq, WIDTH, None, None, RecordSink().round_rows)
        if ctx is not None:
            captured.append((planner.sample, planner.step))
            if ctx.probed:
                probed.append((planner.sample, planner.step))
    assert captured == [(0, 0), (0, 1), (0, 2), (0, 7), (1, 0), (1, 1), (1, 2)]
    assert probed == [(0, 0), (0, 1)]


def test_a_probed_step_a_short_first_sample_never_reached_is_probed_in_the_next():
    # a warm-up call (prefill and one decode step), then two generations of 3 new tokens
    planner = RoundPlanner(DumpConfig(samples=3, steps="0-2", probe_steps="0,2",
                                      probe_samples=1), probing=True)
    probed = []
    for seq in (3, 1, 5, 1, 1, 6, 1, 1):
        planner.advance(seq)
        ctx = planner.open(1, seq, WIDTH, None, None, RecordSink().round_rows)
        if ctx is not None and ctx.probed:
            probed.append((planner.sample, planner.step))
    # the prefill once (the first sample's), step 2 in the first sample that reached it
    assert probed == [(0, 0), (1, 2)]


def test_the_planner_keeps_the_token_ids_and_the_padding_of_the_round():
    planner = RoundPlanner(DumpConfig(), probing=False)
    planner.advance(4)
    ids = torch.arange(8).reshape(2, 4)
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    ctx = planner.open(2, 4, WIDTH, ids, mask, RecordSink().round_rows)
    assert ctx.round.token_ids.tolist() == ids.tolist()
    assert ctx.keep.tolist() == [[False, False, True, True], [True] * 4]
    assert not ctx.probed


def test_probe_rows_take_each_sequences_first_attended_token_and_never_padding_first():
    keep = np.array([[False, False, True, True, True], [True] * 5])
    rows = probe_rows(2, 5, WIDTH, keep, elements=3 * WIDTH, seed=1)
    assert rows.size == 3
    assert {2, 5} <= set(rows.tolist())  # the first attended token of each sequence
    assert not {0, 1} & set(rows.tolist())  # padding is not chosen while attended rows remain
    assert probe_rows(2, 5, WIDTH, keep, elements=None, seed=1).tolist() == list(range(10))
    again = probe_rows(2, 5, WIDTH, keep, elements=3 * WIDTH, seed=1)
    assert again.tolist() == rows.tolist()  # seeded


def test_the_context_reshapes_flat_tokens_and_tables_to_the_round():
    ctx = _context(batch=2, seq=5)
    flat = torch.randn(10, WIDTH)
    assert ctx.as_round(flat).shape == (2, 5, WIDTH)
    assert torch.equal(ctx.as_round(flat).reshape(10, WIDTH), flat)
    assert ctx.token_shaped(torch.zeros(2, 5, WIDTH))
    assert not ctx.token_shaped(torch.zeros(2, 5, 2, 4))  # per-head outputs
    assert not ctx.token_shaped(flat)  # a flat token list of a batch of two
    table = torch.randn(1, 5, WIDTH)
    assert ctx.round_shaped(table).shape == (2, 5, WIDTH)
    assert ctx.round_shaped(torch.randn(1, 6, WIDTH)) is None
    seeds = ctx.seeds(3, -1)
    assert seeds(1, 0) == ctx.seeds(3, -1)(1, 0)
    assert len({seeds(1, 0), seeds(1, 1), seeds(2, 0), ctx.seeds(4, -1)(1, 0)}) == 4


def test_records_of_another_shape_are_dropped_from_the_round():
    ctx = _context(batch=2, seq=5, rows=[0, 7])
    r = ctx.round
    r.tensors = [Tensor(layer=0, site=-1, array=np.zeros((2, 5, WIDTH)), dtype="float32"),
                 Tensor(layer=0, site=-1, array=np.zeros((1, 2, WIDTH)), dtype="float32",
                        kind=schema.KIND_GAIN, subset=True),
                 Tensor(layer=1, site=-1, array=np.zeros((1, 5, WIDTH)), dtype="float32")]
    assert drop_misshapen(r) == 1
    assert [t.layer for t in r.tensors] == [0, 0]


# -- sinks -----------------------------------------------------------------------------------
def test_the_store_option_picks_the_sink():
    spec = ProbeSpec(sigmas=(0.1,), draws=1, dc=(1.0,), repeats=1, batched=True)
    assert isinstance(make_sink(DumpConfig(store="full").parsed().store, spec, 0), TensorSink)
    assert isinstance(make_sink(DumpConfig(store="sample:64").parsed().store, spec, 0),
                      TensorSink)
    assert isinstance(make_sink(DumpConfig(store="stats").parsed().store, spec, 0), StatsSink)


def test_the_tensor_sink_keeps_the_kept_positions_and_the_probe_rows():
    ctx = _context(batch=1, seq=6, rows=[0, 2], positions=[1, 3, 5])
    hidden = torch.randn(1, 6, WIDTH)
    sink = TensorSink()
    sink.open_round(ctx)
    sink.clean(ctx, 0, -1, hidden)
    probe = torch.randn(1, 2, WIDTH)
    sink.probe(ctx, 0, -1, probe, schema.KIND_GAIN, probe=1, param=0.1, seed=7, pert_rms=0.5)
    clean, gain = ctx.round.tensors
    assert np.array_equal(clean.array, hidden[:, [1, 3, 5]].numpy())
    assert gain.kind == schema.KIND_GAIN and gain.subset and gain.seed == 7
    assert np.array_equal(gain.array, probe.numpy())


def test_the_tensor_sink_records_the_padding_mask():
    keep = np.array([[False, True, True]])
    ctx = _context(batch=1, seq=3, keep=keep)
    TensorSink().open_round(ctx)
    (mask,) = ctx.round.tensors
    assert mask.kind == schema.KIND_MASK and mask.array[..., 0].tolist() == [[0.0, 1.0, 1.0]]


def test_the_stats_sink_gives_one_row_per_site_when_it_is_finished():
    spec = ProbeSpec(sigmas=(0.1,), draws=1, dc=(), repeats=1, batched=True)
    sink = make_sink(DumpConfig(store="stats").parsed().store, spec, 0)
    ctx = _context(batch=1, seq=4, rows=[0, 1])
    ctx.round.probe_rows = sink.round_rows(np.array([0, 1]), None, 1, 4, 0, 0)
    sink.open_round(ctx)
    hidden = torch.randn(1, 4, WIDTH)
    sink.clean(ctx, 0, -1, hidden)
    sink.probe(ctx, 0, -1, hidden[:, :2] * 1.01, schema.KIND_GAIN, 0, 0.1, 1, 0.1)
    assert ctx.round.stats == []  # nothing until the site's records are complete
    sink.finish_site(ctx, 0, -1)
    (row,) = ctx.round.stats
    assert (row.layer, row.site) == (0, -1)
    # the block's seeded sample rows are kept as a subset record for the baseline mode
    assert [t.subset for t in ctx.round.tensors] == [True]
    sink.finish_site(ctx, 0, -1)
    assert len(ctx.round.stats) == 1  # a site finished twice gives one row


class _Recorder(RecordSink):
    """A new store mode: one class."""

    def __init__(self):
        self.records = []

    def clean(self, ctx, layer, site, hidden):
        self.records.append(("clean", layer, site, None))

    def probe(self, ctx, layer, site, rows, kind, probe=0, param=0.0, seed=0, pert_rms=0.0,
              subset=True):
        self.records.append(("probe", layer, site, schema.KIND_NAMES[kind], tuple(rows.shape)))


# -- roles and replays -----------------------------------------------------------------------
def test_every_role_has_one_row_and_every_replay_kind_a_function():
    named = {getattr(vocabulary, n) for n in dir(vocabulary)
             if n.isupper() and isinstance(getattr(vocabulary, n), str)}
    assert named == set(roles.ROLE_CAPTURE)
    replays = _replays([])
    assert {row.replay for row in roles.ROLE_CAPTURE.values()} == set(replays._by_kind)
    assert roles.role_capture(vocabulary.ROTARY, in_block=False).hook == roles.PENDING
    assert roles.role_capture(vocabulary.ROTARY).hook == roles.OUTPUT
    assert roles.role_capture(vocabulary.CORE, in_block=False).hook == roles.INPUT


def _replays(sites, spec=None, host=False, sink=None):
    spec = spec or ProbeSpec(sigmas=(0.1,), draws=2, dc=(1.0,), repeats=2, batched=True, scale=True)
    modules = [site.module for site in sites]
    return Replays([nn.Identity()], sites, spec, sink or _Recorder(), Coverage(),
                   TensorParallel(nn.Sequential(*modules), modules), host=host,
                   serving_blocks=set(), moe=None, levels={-1: "block", 0: "operator"})


def test_a_row_wise_operator_is_replayed_on_its_probe_rows_alone():
    torch.manual_seed(0)
    linear = nn.Linear(WIDTH, WIDTH)
    sink = _Recorder()
    replays = _replays([Site(0, "layers.0.mlp.up_proj", linear, vocabulary.LINEAR)],
                       sink=sink, host=True)
    x = torch.randn(1, 6, WIDTH)
    ctx = _context(batch=1, seq=6, rows=[0, 4])
    calls = []
    linear.register_forward_hook(lambda m, a, o: calls.append(a[0].shape))
    replays.replay(linear, 0, 0, (x,), {}, linear(x), ctx)
    kinds = [r[3] for r in sink.records]
    assert kinds.count("gain") == 2 and kinds.count("dc") == 1 and kinds.count("repeat") == 2
    assert "scale" in kinds and kinds[-1] == "host"
    assert {r[4] for r in sink.records} == {(1, 2, WIDTH)}  # the two probe rows only
    assert all(shape[-2] in (2, 4) for shape in calls[1:])  # replays ran on those rows
    assert replays.host_done == 1 and not replays.active
    coverage = replays.coverage.as_dict()
    assert coverage["prefill operator probes"]["done"] == 1
    assert coverage["prefill operator host replays"]["done"] == 1


def test_a_round_without_probe_rows_is_not_replayed():
    linear = nn.Linear(WIDTH, WIDTH)
    sink = _Recorder()
    replays = _replays([Site(0, "layers.0.mlp.up_proj", linear, vocabulary.LINEAR)], sink=sink)
    x = torch.randn(1, 3, WIDTH)
    replays.replay(linear, 0, 0, (x,), {}, linear(x), _context(batch=1, seq=3))
    assert sink.records == []


def test_a_whole_module_is_replayed_with_its_causality_cut():
    class Causal(nn.Module):  # a running mean over the tokens: causal, not row-wise
        is_causal = True

        def forward(self, x):
            return x.cumsum(-2) / torch.arange(1, x.shape[-2] + 1).unsqueeze(-1)

    block = Causal()
    sink = _Recorder()
    spec = ProbeSpec(sigmas=(0.1,), draws=1, dc=(), repeats=1, batched=True, causal=True)
    replays = Replays([block], [], spec, sink, Coverage(), TensorParallel(block, [block]),
                      host=False, serving_blocks=set(), moe=None, levels={-1: "block"})
    x = torch.randn(1, 8, WIDTH)
    replays.replay(block, 0, -1, (x,), {}, block(x), _context(batch=1, seq=8, rows=[0, 5]))
    kinds = [r[3] for r in sink.records]
    assert kinds.count("gain") == 1 and kinds.count("repeat") == 1 and "causal" in kinds
    assert replays.batched + replays.sequential == 1


def test_probe_steps_that_name_no_captured_step_are_refused():
    with pytest.raises(UserError, match="DumpConfig probe_steps 3 names no captured step"):
        DumpConfig(probe_steps="3")  # --steps 0-2,7 by default
    with pytest.raises(UserError, match="bad DumpConfig probe_steps 'x'"):
        DumpConfig(probe_steps="x")
    with pytest.raises(UserError, match="DumpConfig probe_steps 1 names no captured step"):
        DumpConfig(steps="0", probe_steps="1")
    DumpConfig(steps="0")  # the default probe steps 0,1: the prefill is probed
    DumpConfig(steps="3-5")  # later steps captured clean: the default probes none of them
    # the default of earlier versions, as a hunt command printed for their dumps repeats it
    DumpConfig(steps="3-5", probe_steps="0,1,7")
    DumpConfig(probe_steps="0,3")  # the captured one is probed
    DumpConfig(probes="none", probe_steps="3")  # nothing is probed anyway
    DumpConfig(probe_samples=0, probe_steps="3")


def test_a_cache_starts_a_sequence_only_when_its_length_is_known_to_be_zero():
    from srdd_dump.capture.model_facts import starts_sequence

    class Cache:  # transformers' Cache protocol: update and get_seq_length
        def __init__(self, length):
            self.length = length

        def update(self, *args, **kwargs):
            raise AssertionError("never called")

        def get_seq_length(self, layer_idx: int = 0):
            return self.length

    block = nn.Linear(2, 2)
    assert starts_sequence(block, (), {"past_key_values": Cache(0)})
    assert not starts_sequence(block, (), {"past_key_values": Cache(3)})
    # a static cache's length is a device tensor: never read (a host sync per decode step)
    assert not starts_sequence(block, (), {"past_key_values": Cache(torch.tensor(0))})
    assert not starts_sequence(block, (), {})  # no cache: nothing says it starts


def test_a_one_token_prompt_leaves_the_prefill_probes_to_a_longer_one():
    planner = RoundPlanner(DumpConfig(samples=3, steps="0-1", probe_steps="0,1",
                                      probe_samples=1), probing=True)
    probed = []
    # a one-token warm-up prompt (a sample of its own) and its decode step, then a prompt
    for seq, starts in ((1, True), (1, False), (5, False), (1, False)):
        planner.advance(seq, starts)
        ctx = planner.open(1, seq, WIDTH, None, None, RecordSink().round_rows)
        if ctx.probed:
            probed.append((planner.sample, planner.step))
    assert probed == [(0, 1), (1, 0)]  # its decode step is a decode step like any other
