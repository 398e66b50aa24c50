"""A serving engine's flat batch split into its requests (capture/requests.py, rounds.py), on
plain tensors: the engine's forward context is a stand-in module with vLLM's names."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from srdd_dump.capture.config import DumpConfig
from srdd_dump.capture.requests import DUMMY, BatchLayout, RequestTracker, engine_batch
from srdd_dump.capture.rounds import RoundPlanner, split_round
from srdd_dump.capture.sinks import RecordSink
from srdd_dump.format import schema
from srdd_dump.format.writer import Round, Tensor

pytestmark = pytest.mark.capture

BLOCK = 4


def _layout(requests: list[tuple[list[int], list[int]]]) -> tuple[BatchLayout, np.ndarray]:
    """[(positions, cache blocks)] of each request in one forward, as the engine lays it out."""
    lengths = [len(p) for p, _ in requests]
    positions = np.concatenate([p for p, _ in requests]).astype(np.int64)
    width = max(len(b) for _, b in requests)
    table = np.zeros((len(requests), width), dtype=np.int64)
    for i, (_, blocks) in enumerate(requests):
        table[i, :len(blocks)] = blocks
    slots = np.concatenate([[blocks[q // BLOCK] * BLOCK + q % BLOCK for q in p]
                            for p, blocks in requests])
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return BatchLayout(starts=starts, slots=slots, block_table=table), positions


def test_requests_keep_their_sample_across_steps_whatever_their_order_in_the_batch():
    tracker = RequestTracker()
    # two prompts of 4 tokens (the same length: their next positions tie)
    prefill = _layout([(list(range(4)), [7]), (list(range(4)), [3])])
    segments = tracker.split(*prefill)
    assert [(s.sample, s.step, s.start, s.stop) for s in segments] == [(0, 0, 0, 4),
                                                                         (1, 0, 4, 8)]
    # the engine runs them in the other order for the next token (each in a new block)
    decode = _layout([([4], [3, 9]), ([4], [7, 5])])
    assert [(s.sample, s.step) for s in tracker.split(*decode)] == [(1, 1), (0, 1)]
    decode = _layout([([5], [7, 5]), ([5], [3, 9])])
    assert [(s.sample, s.step) for s in tracker.split(*decode)] == [(0, 2), (1, 2)]
    # a new request joins a batch of decode steps
    mixed = _layout([([6], [7, 5]), (list(range(3)), [11])])
    assert [(s.sample, s.step) for s in tracker.split(*mixed)] == [(0, 3), (2, 0)]
    assert tracker.requests == 3 and tracker.unmatched == 0


def test_a_call_that_continues_nothing_known_is_not_a_sample():
    tracker = RequestTracker()
    (segment,) = tracker.split(*_layout([([9], [2, 4, 6])]))
    assert (segment.sample, segment.step) == (-1, -1) and tracker.unmatched == 1


def test_the_planner_captures_the_requests_the_options_select():
    planner = RoundPlanner(DumpConfig(samples=2, store="sample:16", probe_samples=1,
                                      tokens="all"), probing=True)
    layout = _layout([(list(range(5)), [0, 1]), (list(range(3)), [2]), (list(range(2)), [4])])
    ctx = planner.open_requests(*layout, 10, 8, torch.arange(10), RecordSink().round_rows)
    assert [s.sample for s in ctx.segments] == [0, 1]  # the third request is past --samples
    rows = ctx.rows.tolist()
    assert 0 in rows and all(r < 5 for r in rows)  # probed: the first request only
    assert ctx.round.token_ids.tolist() == [list(range(10))]
    assert planner.samples_seen == 2
    tokens = RoundPlanner(DumpConfig(tokens="-1:"), probing=True)
    ctx = tokens.open_requests(*layout, 10, 8, None, RecordSink().round_rows)
    assert [s.kept.tolist() for s in ctx.segments] == [[4], [7], [9]]  # per request
    assert set(ctx.rows.tolist()) <= {4, 7, 9}  # probe rows among the kept rows
    # a later forward with only requests past --samples: everything asked for is captured
    later = _layout([([5], [0, 1, 5]), ([3], [2, 6])])
    ctx = planner.open_requests(*later, 2, 8, None, RecordSink().round_rows)
    assert ctx is not None and ctx != RoundPlanner.DONE  # requests 0 and 1 still decode
    done = _layout([(list(range(4)), [9])])
    assert planner.open_requests(*done, 4, 8, None, RecordSink().round_rows) == RoundPlanner.DONE


def test_a_flat_round_becomes_one_round_per_request():
    tracker = RequestTracker()
    segments = tracker.split(*_layout([(list(range(4)), [0]), (list(range(3)), [1])]))
    flat = np.arange(7 * 2, dtype=np.float32).reshape(1, 7, 2)
    r = Round(sample=0, step=0, batch=1, seq=7, positions=np.arange(7),
              token_ids=np.arange(100, 107).reshape(1, 7), probe_rows=np.array([0, 4, 6]))
    r.tensors = [Tensor(layer=0, site=-1, array=flat, dtype="float32"),
                 Tensor(layer=0, site=-1, array=flat[:, [0, 4, 6]], dtype="float32",
                        kind=schema.KIND_GAIN, subset=True)]
    first, second = split_round(r, segments)
    assert (first.sample, first.seq, second.sample, second.seq) == (0, 4, 1, 3)
    assert second.positions.tolist() == [0, 1, 2]
    assert second.token_ids.tolist() == [[104, 105, 106]]
    assert np.array_equal(second.tensors[0].array, flat[:, 4:7])
    assert first.probe_rows.tolist() == [0] and second.probe_rows.tolist() == [0, 2]
    assert np.array_equal(second.tensors[1].array, flat[:, [4, 6]])
    # --tokens applies within each request (the planner keeps its last token: flat row 6)
    segments[1].kept = np.array([6])
    last, = split_round(r, segments[1:])
    assert last.positions.tolist() == [2] and last.probe_rows.tolist() == [0]
    assert np.array_equal(last.tensors[0].array, flat[:, [6]])


def test_the_engine_batch_is_read_from_the_forward_context(monkeypatch):
    state = {"context": None}
    fake = types.ModuleType("vllm.forward_context")
    fake.is_forward_context_available = lambda: state["context"] is not None
    fake.get_forward_context = lambda: state["context"]
    monkeypatch.setitem(sys.modules, "vllm.forward_context", fake)
    assert engine_batch() is None  # outside a forward
    state["context"] = SimpleNamespace(attn_metadata=None)
    assert engine_batch() == DUMMY  # a dummy or profile run
    meta = SimpleNamespace(query_start_loc=torch.tensor([0, 3, 5, 5]), num_actual_tokens=5,
                           slot_mapping=torch.arange(8), block_table=torch.zeros(3, 2))
    state["context"] = SimpleNamespace(attn_metadata={"model.layers.0.self_attn.attn": meta})
    layout = engine_batch()
    assert layout.starts.tolist() == [0, 3, 5, 5] and layout.n_requests == 3
    monkeypatch.delitem(sys.modules, "vllm.forward_context")
    assert engine_batch() is None  # no engine


def test_a_finished_requests_blocks_given_to_a_new_one_do_not_confuse_them():
    tracker = RequestTracker()
    tracker.split(*_layout([(list(range(7)), [1, 2])]))  # request 0 ends after its prefill
    tracker.split(*_layout([(list(range(5)), [1, 2])]))  # request 1 gets its blocks
    # at its third step, request 1 is where request 0 ended: next position 7, block 2
    steps = [tracker.split(*_layout([([5 + k], [1, 2, 3])]))[0] for k in range(3)]
    assert [(s.sample, s.step) for s in steps] == [(1, 1), (1, 2), (1, 3)]


def test_a_causality_cut_is_read_within_its_request():
    tracker = RequestTracker()
    segments = tracker.split(*_layout([(list(range(4)), [0]), (list(range(3)), [1])]))
    r = Round(sample=0, step=0, batch=1, seq=7, positions=np.arange(7),
              probe_rows=np.array([0, 4, 6]))
    r.tensors = [Tensor(layer=0, site=-1, array=np.zeros((1, 7, 2)), dtype="float32"),
                 Tensor(layer=0, site=-1, array=np.zeros((1, 3, 2)), dtype="float32",
                        kind=schema.KIND_CAUSAL, param=5.0, subset=True)]
    first, second = split_round(r, segments)
    # the first request was not perturbed: its copy tests nothing and is left out
    assert [t.kind for t in first.tensors] == [schema.KIND_CLEAN]
    assert second.tensors[1].param == 1.0  # flat row 5 is the second request's position 1


def test_a_vllm_batch_without_its_layout_is_reported_not_guessed(monkeypatch):
    from srdd_dump.capture.requests import read_batch

    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.delitem(sys.modules, "vllm.forward_context", raising=False)

    positions = torch.arange(6)
    assert read_batch(positions) == (None, None, None)  # no engine: a flat single sequence
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    layout, flat, why = read_batch(positions)  # vLLM, but no forward context to split by
    assert layout is None and flat is None and "forward context" in why


def test_calls_that_are_not_captured_are_counted():
    planner = RoundPlanner(DumpConfig(samples=4), probing=False)
    rows = RecordSink().round_rows
    planner.open_requests(*_layout([(list(range(4)), [3, 4])]), 4, 8, None, rows)
    # the rest of a prompt chunked over two forwards, and a call nobody began
    planner.open_requests(*_layout([([4, 5, 6], [3, 4]), ([9], [7, 8, 9])]), 4, 8, None, rows)
    assert planner.request_calls[0] is None
    assert "chunked prefill" in planner.request_calls[1]
    assert "continues no request" in planner.request_calls[2]


def test_the_stats_store_reduces_each_request_as_if_it_ran_alone():
    from srdd_dump.capture.probes import ProbeSpec
    from srdd_dump.capture.rounds import RoundContext
    from srdd_dump.capture.sinks import make_sink

    spec = ProbeSpec(sigmas=(0.1,), draws=1, dc=(), repeats=0, batched=True)
    store = DumpConfig(store="stats").parsed().store
    planner = RoundPlanner(DumpConfig(store="stats"), probing=True)
    layout = _layout([(list(range(5)), [0, 1]), (list(range(4)), [2])])
    torch.manual_seed(0)
    hidden = torch.randn(1, 9, 8)
    gain = hidden * 1.01
    flat_sink = make_sink(store, spec, 0)
    ctx = planner.open_requests(*layout, 9, 8, None, flat_sink.round_rows)
    flat_sink.open_round(ctx)
    flat_sink.clean(ctx, 0, -1, hidden)
    flat_sink.probe(ctx, 0, -1, gain[:, ctx.rows], schema.KIND_GAIN, 0, 0.1, 1, 0.1)
    flat_sink.finish_site(ctx, 0, -1)
    for seg in ctx.segments:
        alone = make_sink(store, spec, 0)
        rows = ctx.rows[(ctx.rows >= seg.start) & (ctx.rows < seg.stop)]
        own = RoundContext(
            round=Round(sample=seg.sample, step=0, batch=1, seq=seg.stop - seg.start,
                        positions=seg.positions, probe_rows=None),
            positions=None, rows=rows - seg.start, seed=0)
        alone.open_round(own)
        alone.clean(own, 0, -1, hidden[:, seg.start:seg.stop])
        alone.probe(own, 0, -1, gain[:, rows], schema.KIND_GAIN, 0, 0.1, 1, 0.1)
        alone.finish_site(own, 0, -1)
        (want,), (got,) = own.round.stats, seg.stats
        assert np.array_equal(want.values, got.values, equal_nan=True)


def test_a_request_continues_only_from_the_forward_before():
    tracker = RequestTracker()
    tracker.split(*_layout([(list(range(7)), [3, 4])]))  # request 0: ends here (7 tokens)
    # request 1, a second turn past the prefix the engine cached (its one full block, 4
    # tokens): it starts at 4, not where request 0 ended
    (turn,) = tracker.split(*_layout([([4, 5, 6, 7, 8], [3, 6, 7])]))
    assert (turn.sample, turn.step) == (1, 0)  # a new request, not request 0's chunk
    (step,) = tracker.split(*_layout([([9], [3, 6, 7])]))
    assert (step.sample, step.step) == (1, 1)
    # a request missing from one forward (finished, preempted) continues nothing later
    (gone,) = tracker.split(*_layout([([7], [3, 4])]))
    assert (gone.sample, gone.step) == (-1, -1) and tracker.unmatched == 1


def test_without_the_cache_layout_a_tie_is_not_guessed():
    tracker = RequestTracker()
    plain = BatchLayout(starts=np.array([0, 4, 8]), slots=None, block_table=None)
    tracker.split(plain, np.array([0, 1, 2, 3, 0, 1, 2, 3]))
    step = BatchLayout(starts=np.array([0, 1, 2]), slots=None, block_table=None)
    segments = tracker.split(step, np.array([4, 4]))
    assert [(s.sample, s.step) for s in segments] == [(-1, -1), (-1, -1)]
    alone = RequestTracker()
    alone.split(BatchLayout(starts=np.array([0, 4]), slots=None, block_table=None),
                np.arange(4))
    (one,) = alone.split(BatchLayout(starts=np.array([0, 1]), slots=None, block_table=None),
                         np.array([4]))
    assert (one.sample, one.step) == (0, 1)


def test_metadata_without_request_starts_is_reported(monkeypatch):
    from srdd_dump.capture.requests import read_batch

    fake = types.ModuleType("vllm.forward_context")
    fake.is_forward_context_available = lambda: True
    fake.get_forward_context = lambda: SimpleNamespace(
        attn_metadata={"layer": SimpleNamespace(seq_lens=torch.tensor([3]))})
    monkeypatch.setitem(sys.modules, "vllm.forward_context", fake)
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    layout, flat, why = read_batch(torch.arange(3))
    assert layout is None and "query_start_loc" in why  # not taken for a dummy run
    # multimodal rotary positions (3, tokens): the text row
    fake.get_forward_context = lambda: SimpleNamespace(attn_metadata={"layer": SimpleNamespace(
        query_start_loc=torch.tensor([0, 3]), num_actual_tokens=3, slot_mapping=None,
        block_table=None)})
    layout, flat, why = read_batch(torch.arange(3).repeat(3, 1))
    assert flat.tolist() == [0, 1, 2] and why is None


def test_the_stats_stores_kept_rows_of_a_request_do_not_depend_on_its_batch():
    from srdd_dump.capture.probes import ProbeSpec
    from srdd_dump.capture.sinks import make_sink

    spec = ProbeSpec(sigmas=(), draws=0, dc=(), repeats=0, batched=True)
    sink = make_sink(DumpConfig(store="stats").parsed().store, spec, 0)
    planner = RoundPlanner(DumpConfig(store="stats"), probing=False)
    layout = _layout([(list(range(200)), list(range(3, 53))), ([7], [60, 61])])
    planner.requests.split(*_layout([(list(range(7)), [60, 61])]))  # the decoding request
    ctx = planner.open_requests(*layout, 201, 8, None, sink.round_rows)
    for seg in ctx.segments:
        rows = ctx.round.probe_rows
        mine = rows[(rows >= seg.start) & (rows < seg.stop)] - seg.start
        alone = sink.round_rows(None, None, 1, seg.stop - seg.start, seg.sample, seg.step)
        assert mine.tolist() == sorted(alone.tolist()) and mine.size


def test_a_probed_step_goes_to_the_first_request_that_reaches_it():
    # request 0 ends after its prefill; request 1 goes on: its decode step 1 is the first
    planner = RoundPlanner(DumpConfig(samples=2, steps="0-2", probe_steps="0,1",
                                      probe_samples=1, store="sample:16"), probing=True)
    rows = RecordSink().round_rows
    prefill = planner.open_requests(*_layout([(list(range(4)), [0]), (list(range(3)), [1])]),
                                    7, 8, None, rows)
    assert [(s.sample, s.step, s.probed) for s in prefill.segments] == [
        (0, 0, True), (1, 0, False)]
    step1 = planner.open_requests(*_layout([([3], [1])]), 1, 8, None, rows)
    assert [(s.sample, s.step, s.probed) for s in step1.segments] == [(1, 1, True)]
    assert step1.rows is not None
    step2 = planner.open_requests(*_layout([([4], [1, 5])]), 1, 8, None, rows)
    assert [(s.sample, s.step, s.probed) for s in step2.segments] == [(1, 2, False)]
