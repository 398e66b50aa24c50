"""A dump of some blocks (--layers) names the model's layers by the model's numbers: the
report's layer column, the headline and --inject layer=K all say layer 10 for model.layers.10,
not its position 0 in the file (a new user's hunt dump once reported "Layer 0
(model.layers.10.mlp)")."""

from __future__ import annotations

import math
import os

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
    # --layers naming modules inside the blocks; names that end in their number
    assert layer_numbers(["model.layers.10.mlp", "model.layers.12.mlp"]) == [10, 12]
    assert layer_numbers(["layers.3.mlp.fc1", "layers.4.mlp.fc1"]) == [3, 4]
    assert layer_numbers(["block1", "block2"]) == [1, 2]
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
    assert any("a dump of 2 of the model's 4 blocks: the test that compares a layer's mean "
               "offset with the other layers' is weaker there" in n
               for n in result.notes), result.notes


@pytest.mark.capture
def test_inject_names_a_block_the_dump_does_not_capture(tmp_path):
    with pytest.raises(UserError, match=r"layer 0 out of range: the captured blocks are "
                                        r"layers 2-3 \(model.layers.2 to model.layers.3\)"):
        _capture(tmp_path, "model.layers.[23]", ["bias@layer=0"])
    # a negative layer counts from the last captured block
    session = _capture(tmp_path / "neg", "model.layers.[23]", ["bias@layer=-1,m=2"])
    assert [f["module"] for f in session.faults] == ["model.layers.3"]


@pytest.mark.unit
def test_a_dump_from_a_later_layer_is_judged_as_one_from_the_first():
    """Baseline divergence without device names (msprobe dumps): a dump of layers 10-12 reads
    like one of layers 0-2 (its first block's input is no computed block's output; it once
    read as 'error born at layer 10 from an exact input')."""
    import pandas as pd

    from srdd_dump.compare.divergence import mark_divergence, summarize
    from srdd_dump.compare.results import BASELINE_COLUMNS, DERIVED_COLUMNS

    def pattern(layers: list[int]) -> tuple[str, str]:
        rows = [dict(source="r0.h5", golden_source="r0.h5", sample=0, golden_sample=0, step=0,
                     layer=k, golden_layer=k, module=f"model.layers.{k}",
                     golden_module=f"model.layers.{k}", input_match="unknown", verdict=v,
                     relative_euclidean_distance=red, cosine_similarity=1 - red,
                     tolerance="bfloat16", my_dtype="bfloat16", golden_dtype="bfloat16",
                     golden_nan_inf=0, my_nan_inf=0, cmp_fail_reason="")
                for k, red, v in zip(layers, (3e-3, 6e-3, 1.2e-2), ("PASS", "PASS", "WARN"))]
        table = pd.DataFrame(rows).reindex(
            columns=[c for c in BASELINE_COLUMNS if c not in DERIVED_COLUMNS])
        same = {("r0.h5", "r0.h5"): False}
        summary = summarize(mark_divergence(table, same), same)
        return summary.pattern, summary.message

    first, later = pattern([0, 1, 2]), pattern([10, 11, 12])
    assert first[0] == later[0] == "gradual", (first, later)


@pytest.mark.unit
def test_layer_0_of_dumps_without_a_stack_input_takes_the_input_ids():
    """msprobe dumps of block outputs only hold no stack input: layer 0's input is still the
    input ids, so a fault at layer 0 is introduced there (not 'unlocated')."""
    import pandas as pd

    from srdd_dump.compare.divergence import mark_divergence, summarize
    from srdd_dump.compare.results import BASELINE_COLUMNS, DERIVED_COLUMNS

    rows = [dict(source="r0.h5", golden_source="r0.h5", sample=0, golden_sample=0, step=0,
                 layer=k, golden_layer=k, module=f"model.layers.{k}",
                 golden_module=f"model.layers.{k}", input_match="same", verdict="FAIL",
                 relative_euclidean_distance=0.2, cosine_similarity=0.98, tolerance="float32",
                 my_dtype="float32", golden_dtype="float32", golden_nan_inf=0, my_nan_inf=0,
                 cmp_fail_reason="") for k in range(3)]
    table = pd.DataFrame(rows).reindex(
        columns=[c for c in BASELINE_COLUMNS if c not in DERIVED_COLUMNS])
    same = {("r0.h5", "r0.h5"): True}
    summary = summarize(mark_divergence(table, same), same)
    assert (summary.pattern, summary.first_layer) == ("introduced", 0), summary.message


@pytest.mark.capture
def test_baseline_numbers_each_side_by_its_own_blocks_when_the_file_names_match(tmp_path):
    """Two dumps whose files are named alike (rank 0 of the same pid, two msprobe dumps):
    my layers of a dump of layers 2-3 are 2 and 3, paired with the golden 2 and 3 (they
    were numbered by the golden file's blocks: 0 and 1)."""
    from srdd_dump.compare import compare_baseline

    model = build("llama", layers=4)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    paths = {}
    for side, layers in (("golden", None), ("mine", "model.layers.[23]")):
        cfg = DumpConfig(dump_path=str(tmp_path / side), probes="none", layers=layers)
        with register_hook(model, cfg) as session, torch.no_grad():
            model(input_ids=ids)
        paths[side] = session.path
    assert os.path.basename(paths["mine"]) == os.path.basename(paths["golden"])
    t = compare_baseline(paths["mine"], paths["golden"]).table
    blocks = t[t["layer"].notna() & t["golden_layer"].notna()]
    # my stack input (-1) is the output of the golden layer 1, the block before my first
    assert sorted(zip(blocks["layer"], blocks["golden_layer"])) == [(-1, 1), (2, 2), (3, 3)], \
        blocks[["layer", "golden_layer", "module", "golden_module"]]
    assert set(blocks["verdict"]) == {"PASS"}
    # the golden stack input pairs with nothing, and says so (it was dropped)
    alone = t[t["layer"].isna() & (t["golden_layer"] == -1)]
    assert len(alone) == 1
    assert alone["cmp_fail_reason"].iloc[0].startswith("no counterpart: the golden stack input")


@pytest.mark.capture
def test_baseline_with_a_dump_of_some_layers_names_no_birth_it_cannot_see(tmp_path):
    """A fault before the layers a subset dump holds: no layer 'introduced' it (the first
    layer both dumps hold has an unknown input); the finding bounds where it was born. A fault
    inside them is named as before (a new user's trial got 'layer 9 introduced the error' for a
    fault at layer 5, and a missed fault at layer 10 against a subset golden dump)."""
    from srdd_dump.compare import compare_baseline

    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))

    def dump(name: str, layers: str | None = None, inject: tuple[str, ...] = ()) -> str:
        model = build("llama", layers=4)
        cfg = DumpConfig(dump_path=str(tmp_path / name), probes="none", layers=layers,
                         inject=list(inject))
        with register_hook(model, cfg) as session, torch.no_grad():
            model(input_ids=ids)
        return session.path

    early = dump("early", inject=("bias@layer=1,site=mlp,m=3",))
    inside = dump("inside", inject=("bias@layer=2,site=mlp,m=3",))
    some = dump("some", layers="model.layers.[23]")
    for mine, golden in ((early, some), (some, early)):
        summary = compare_baseline(mine, golden).summary
        assert summary.pattern == "unlocated", summary.message
        assert "introduced" not in summary.message and "born at" not in summary.message
    summary = compare_baseline(inside, some).summary
    assert (summary.pattern, summary.first_layer) == ("introduced", 2), summary.message


@pytest.mark.capture
def test_a_block_after_a_gap_in_the_layers_has_no_signals_of_its_input(tmp_path):
    """``--layers 'model.layers.[013]'``: layer 3's input is layer 2's output, not captured.
    Its update and kurtosis change were computed against layer 1's output (a new user's
    ``model.layers.2*`` gave layer 20 an update RMS 45x the full dump's); layer 1's, which
    follows layer 0, are the full dump's."""
    from srdd_dump.compare.api import file_signals

    def signals(name: str, layers: str | None) -> dict:
        model = build("llama", layers=4)
        cfg = DumpConfig(dump_path=str(tmp_path / name), layers=layers, probes="none")
        with register_hook(model, cfg) as session, torch.no_grad():
            model(input_ids=torch.randint(0, 128, (1, 24),
                                          generator=torch.Generator().manual_seed(0)))
        numbers = layer_numbers([f"model.layers.{k}" for k in range(4)] if layers is None
                                else ["model.layers.0", "model.layers.1", "model.layers.3"])
        return {numbers[g.layer]: g for g in file_signals(session.path)
                if g.site == -1 and g.phase == "prefill"}

    full, some = signals("full", None), signals("some", "model.layers.[013]")
    assert sorted(some) == [0, 1, 3]
    assert some[1].update_rms == pytest.approx(full[1].update_rms)
    assert some[1].kurt_change == pytest.approx(full[1].kurt_change)
    for name in ("update_rms", "offset", "dc_energy", "consistency", "kurt_change"):
        assert math.isnan(getattr(some[3], name)), name
        assert not math.isnan(getattr(full[3], name)), name
