"""A sub-layer's repeats are taken from its block's repeats when its input there is its
recorded input bit for bit (capture/shared_repeats.py), and run alone otherwise: the repeat
records are what a sub-layer re-run alone gives, in both cases."""

from __future__ import annotations

import glob

import numpy as np
import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.format import schema
from srdd_dump.format.reader import DumpReader

from tiny_models import build

pytestmark = pytest.mark.capture

PROMPT = torch.tensor([[5, 17, 9, 33, 61, 2, 44, 8, 19, 70, 12, 3]])


def _dump(tmp_path, model):
    session = register_hook(model, DumpConfig(dump_path=str(tmp_path), samples=1,
                                              progress=False))
    with torch.no_grad():
        model.generate(PROMPT, max_new_tokens=3, do_sample=False, pad_token_id=0)
    session.close()
    return DumpReader(glob.glob(str(tmp_path / "*.h5"))[0])


def _sublayer_repeats(reader: DumpReader, name: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(clean rows at the probe rows, repeat) of every repeat record of sub-layer ``name``."""
    site = reader.sites.index(name)
    pairs = []
    for rec in reader.select(kind=schema.KIND_REPEAT, site=site):
        round_row = reader.rounds[int(rec["round"])]
        clean = next(c for c in reader.select(layer=int(rec["layer"]), site=site)
                     if int(c["round"]) == int(rec["round"]))
        rows = reader.read(clean).reshape(-1, reader.read(clean).shape[-1])
        pairs.append((rows[reader.probe_rows(round_row)], reader.read(rec).reshape(
            -1, rows.shape[-1])))
    return pairs


def test_sublayer_repeats_come_from_the_block_and_equal_the_recorded_output(tmp_path):
    model = build("llama", layers=3)
    reader = _dump(tmp_path, model)
    # 3 layers x 2 sub-layers x 3 repeats, in each probed round (the prefill, decode step 1)
    assert reader.status["repeats_from_blocks"] == 3 * 2 * 3 * 2
    for name in ("model.layers.1.self_attn", "model.layers.2.mlp"):
        pairs = _sublayer_repeats(reader, name)
        assert len(pairs) == 6
        for clean, again in pairs:
            np.testing.assert_array_equal(again, clean)


def test_a_sublayer_whose_input_differs_in_the_block_run_repeats_alone(tmp_path):
    """An unstable norm before the attention: in the block's repeats the attention sees
    another input, so its repeats are its own re-runs on its recorded input (equal to the
    recorded output), not the block run's outputs."""
    model = build("llama", layers=3)
    norm = model.model.layers[1].input_layernorm
    calls = {"n": 0}

    def unstable(module, args, output):
        calls["n"] += 1
        return output + 1e-3 * calls["n"]  # a different output at every call

    handle = norm.register_forward_hook(unstable)
    try:
        reader = _dump(tmp_path, model)
    finally:
        handle.remove()
    # layer 1's attention and, after it, its MLP (3 repeats x 2 probed rounds each) ran
    # alone; the other layers' sub-layers shared their block's repeats
    assert reader.status["repeats_from_blocks"] == 3 * 2 * 3 * 2 - 12
    for name in ("model.layers.1.self_attn", "model.layers.1.mlp"):
        pairs = _sublayer_repeats(reader, name)
        assert len(pairs) == 6
        for clean, again in pairs:
            np.testing.assert_array_equal(again, clean)
