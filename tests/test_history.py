"""The running hash of a sample's input ids (capture/history.py)."""

from __future__ import annotations

import pytest
import torch

from srdd_dump.capture import history
from srdd_dump.capture.history import TokenHistory


def _run(steps, record_at, ids_of=lambda k: torch.tensor([[k + 3]])):
    h = TokenHistory()
    h.start()
    h.add(torch.arange(6).reshape(1, 6))  # the prefill
    h.record(0, 0)
    for k in range(1, steps + 1):
        h.add(ids_of(k))
        if k in record_at:
            h.record(0, k)
    return h.known


@pytest.mark.unit
def test_the_hash_of_a_step_is_the_same_whichever_steps_were_captured(monkeypatch):
    every = _run(9, set(range(1, 10)))
    some = _run(9, {1, 2, 7})
    monkeypatch.setattr(history, "FOLD", 2)  # folded on the way, not only at records
    folded = _run(9, {7})
    assert some[(0, 7)] == every[(0, 7)] == folded[(0, 7)]
    assert some.keys() == {(0, 0), (0, 1), (0, 2), (0, 7)}
    # another token at a step not captured: step 7's hash differs
    other = _run(9, {1, 2, 7}, lambda k: torch.tensor([[99 if k == 4 else k + 3]]))
    assert other[(0, 2)] == some[(0, 2)] and other[(0, 7)] != some[(0, 7)]


@pytest.mark.unit
def test_a_forward_without_ids_or_undone_leaves_no_wrong_hash():
    h = TokenHistory()
    h.start()
    h.add(torch.arange(4).reshape(1, 4))
    mark = h.mark()
    h.add(torch.tensor([[7]]))  # a forward that raised: undone
    h.undo(mark)
    h.add(torch.tensor([[8]]))
    h.record(0, 1)
    clean = TokenHistory()
    clean.start()
    clean.add(torch.arange(4).reshape(1, 4))
    clean.add(torch.tensor([[8]]))
    clean.record(0, 1)
    assert h.known == clean.known
    h.add(None)  # ids not visible (inputs_embeds): unknown from here on, until a new sample
    h.add(torch.tensor([[9]]))
    h.record(0, 2)
    assert (0, 2) not in h.known
    h.start()
    h.add(torch.arange(3).reshape(1, 3))
    h.record(1, 0)
    assert (1, 0) in h.known
