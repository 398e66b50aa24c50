"""A dump of some blocks (--layers) names the model's layers by the model's numbers: the
report's layer column, the headline and --inject layer=K all say layer 10 for model.layers.10,
not its position 0 in the file (a new user's hunt dump once reported "Layer 0
(model.layers.10.mlp)")."""

from __future__ import annotations

import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.compare import compare_path
from srdd_dump.errors import UserError
from srdd_dump.format.layer_numbers import layer_numbers, number_of

from tiny_models import build


@pytest.mark.unit
def test_the_numbers_are_the_names_trailing_integers_of_one_stack():
    assert layer_numbers(["model.layers.10", "model.layers.11"]) == [10, 11]
    assert layer_numbers(["transformer.h.0", "transformer.h.7"]) == [0, 7]
    # two stacks (an encoder's and a decoder's), or names without numbers: positions
    assert layer_numbers(["encoder.layer.0", "encoder.layer.1", "decoder.layer.0"]) == [0, 1, 2]
    assert layer_numbers(["blocks.first", "blocks.second"]) == [0, 1]
    assert layer_numbers([]) == []
    assert number_of([10, 11], 1) == 11
    assert number_of([10, 11], -1) == -1 and number_of([10, 11], None) is None


def _capture(tmp_path, layers: str, inject: list[str]) -> str:
    model = build("llama", layers=4)
    cfg = DumpConfig(dump_path=str(tmp_path), layers=layers, inject=inject, repeats=1)
    with register_hook(model, cfg) as session, torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0)))
    return session


@pytest.mark.capture
def test_a_dump_of_some_layers_reports_and_injects_by_the_models_numbers(tmp_path):
    session = _capture(tmp_path, "model.layers.[23]", ["dead_zone@layer=2,site=mlp,m=0.3"])
    assert [f["module"] for f in session.faults] == ["model.layers.2.mlp"]
    result = compare_path(session.path, jobs=1, progress=False)
    layers = result.layers
    assert sorted(layers["layer"]) == [2, 3]
    assert set(zip(layers["layer"], layers["module"])) == {(2, "model.layers.2"),
                                                           (3, "model.layers.3")}
    sites = result.sites
    assert set(sites["layer"]) <= {2, 3}
    assert all(name.startswith(f"model.layers.{k}.")
               for k, name in zip(sites["layer"], sites["module"]))
    top = layers.iloc[0]
    assert (top["layer"], top["verdict"], top["site"]) == (2, "FAULT", "model.layers.2.mlp")
    (line,) = result.headlines
    assert "Layer 2 (model.layers.2.mlp): FAULT" in line, line


@pytest.mark.capture
def test_inject_names_a_block_the_dump_does_not_capture(tmp_path):
    with pytest.raises(UserError, match=r"layer 0 out of range: the captured blocks are "
                                        r"layers 2-3 \(model.layers.2 to model.layers.3\)"):
        _capture(tmp_path, "model.layers.[23]", ["bias@layer=0"])
    # a negative layer counts from the last captured block
    session = _capture(tmp_path / "neg", "model.layers.[23]", ["bias@layer=-1,m=2"])
    assert [f["module"] for f in session.faults] == ["model.layers.3"]
