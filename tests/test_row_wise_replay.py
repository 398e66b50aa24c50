"""A gated MLP's probes on a long call run on its probe rows alone (replays._row_wise): the
perturbed inputs are those of a whole-call replay cut to the probe rows, so the probe records
equal the whole call's at those rows up to the rounding of another GEMM shape; the repeats
still re-run the whole call."""

from __future__ import annotations

import glob

import numpy as np
import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.capture import replays
from srdd_dump.format import schema
from srdd_dump.format.reader import DumpReader

from tiny_models import build

pytestmark = pytest.mark.capture

TOKENS = 24
PROMPT = torch.tensor([[(7 * i + 3) % 120 + 1 for i in range(TOKENS)]])
STORE = "sample:256"  # 4 probe rows of the tiny models' 64 channels: a sixth of the prompt
PROBE_ROWS = 256 // 64
PROBED_KINDS = (schema.KIND_REPLAY, schema.KIND_GAIN, schema.KIND_DC)


def _dump(path, model, mlp) -> tuple[DumpReader, list[tuple[int, ...]]]:
    """The dump of one generation and the input shapes of every call of ``mlp``."""
    shapes: list[tuple[int, ...]] = []
    handle = mlp.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
    session = register_hook(model, DumpConfig(dump_path=str(path), samples=1, store=STORE,
                                              progress=False))
    with torch.no_grad():
        model.generate(PROMPT, max_new_tokens=2, do_sample=False, pad_token_id=0)
    session.close()
    handle.remove()
    return DumpReader(glob.glob(str(path / "*.h5"))[0]), shapes


def _records(reader: DumpReader, name: str, kinds) -> dict[tuple, np.ndarray]:
    site = reader.sites.index(name)
    return {(int(r["round"]), int(r["kind"]), int(r["probe"]), float(r["param"]),
             int(r["seed"])): reader.read(r)
            for r in reader.select(kind=None, site=site) if int(r["kind"]) in kinds}


def _copies() -> int:
    """The copies of an MLP's batched probe replay: the unperturbed one, the gain draws and the
    dc shifts of the default probes."""
    spec = DumpConfig()
    return 1 + len(spec.sigmas) * spec.draws + len(spec.dc)


def test_a_long_call_probes_a_gated_mlp_on_its_probe_rows_alone(tmp_path, monkeypatch):
    model = build("llama", layers=2)
    mlp = model.model.layers[1].mlp
    spec = DumpConfig()  # the default probes
    copies = _copies()
    assert spec.repeats > 0 and copies > 2
    _, shapes = _dump(tmp_path / "rows", model, mlp)
    assert (copies, PROBE_ROWS, 64) in shapes
    assert (copies, TOKENS, 64) not in shapes
    assert shapes.count((1, TOKENS, 64)) == 1 + spec.repeats  # its own call, the block's
    monkeypatch.setattr(replays, "ROW_WISE_SHARE", 0.0)  # every call replayed whole
    _, shapes = _dump(tmp_path / "whole", model, mlp)
    assert (copies, TOKENS, 64) in shapes
    assert (copies, PROBE_ROWS, 64) not in shapes


def test_the_probe_rows_alone_give_the_whole_calls_records(tmp_path, monkeypatch):
    model = build("llama", layers=2)
    rows, _ = _dump(tmp_path / "rows", model, model.model.layers[0].mlp)
    monkeypatch.setattr(replays, "ROW_WISE_SHARE", 0.0)
    whole, _ = _dump(tmp_path / "whole", model, model.model.layers[0].mlp)
    for layer in range(2):
        name = f"model.layers.{layer}.mlp"
        a, b = _records(rows, name, PROBED_KINDS), _records(whole, name, PROBED_KINDS)
        assert a.keys() == b.keys() and {k[1] for k in a} == set(PROBED_KINDS)
        assert any(v.shape == (1, PROBE_ROWS, 64) for v in a.values())  # the prefill's
        for key in a:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6)
        # the repeats re-run the whole call in both: the same records bit for bit
        rounds = {k[0] for k in a}  # the probed rounds: the prefill, decode step 1
        a, b = (_records(r, name, (schema.KIND_REPEAT,)) for r in (rows, whole))
        assert len(a) == DumpConfig().repeats * len(rounds) and a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_a_short_call_and_an_mlp_of_another_kind_are_replayed_whole(tmp_path):
    model = build("gpt2", layers=2)  # Conv1D projections: no gated MLP of the HF kind
    mlp = model.transformer.h[1].mlp
    _, shapes = _dump(tmp_path / "gpt2", model, mlp)
    copies = _copies()
    assert (copies, TOKENS, 64) in shapes and (copies, PROBE_ROWS, 64) not in shapes
