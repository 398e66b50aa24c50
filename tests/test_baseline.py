"""GPU-baseline mode and multi-card consistency: real tiny models captured with register_hook
(fp32 golden, planted faults, bf16), synthetic dumps for the corner cases, msit metrics by hand,
the CLI end to end, and -j 2 == -j 1."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
import zipfile

import numpy as np
import openpyxl
import pandas as pd
import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.analysis import metrics as M
from srdd_dump.analysis.matching import pair_layers, pair_samples
from srdd_dump.analysis.tolerance import Thresholds, tolerance_dtype
from srdd_dump.analysis.verdicts import FAIL, NOT_COMPARED
from srdd_dump.compare import check_consistency
from srdd_dump.compare.results import BASELINE_COLUMNS, MSIT_COLUMNS
from srdd_dump.errors import UserError
from srdd_dump.format import blocks as streaming
from srdd_dump.format import schema as s
from srdd_dump.format.reader import find_dump_files
from srdd_dump.report.consistency import write_consistency
from srdd_dump.report.terminal import consistency_text

from capture_utils import ROOT, run_cli
from dumpfactory import baseline_written as compare_baseline
from dumpfactory import normal_rounds, write_dump
from tiny_models import build

PROMPTS = [torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(k))
           for k in range(3)]
FAULT = "noise@layer=2,site=mlp,m=0.05"


def capture(folder, *, dtype=torch.float32, inject=(), layers=4, prompts=PROMPTS[:1],
            new_tokens=0, steps="0", arch="llama") -> str:
    model = build(arch, layers=layers, dtype=dtype)
    cfg = DumpConfig(dump_path=str(folder), probes="none", inject=list(inject), steps=steps)
    with register_hook(model, cfg) as session, torch.no_grad():
        for ids in prompts:
            if new_tokens:
                model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            else:
                model(input_ids=ids)
    return session.path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {
        "golden": capture(root / "golden"),
        "fault": capture(root / "fault", inject=[FAULT]),
        "bf16": capture(root / "bf16", dtype=torch.bfloat16),
    }


def compare(mine, golden, **kw):
    return compare_baseline(str(mine), str(golden), progress=False, **kw)


def block_rows(t: pd.DataFrame) -> pd.DataFrame:
    return t[t["layer"].notna()]


def generated(folder, ids, mask=None, **options) -> str:
    """The dump of a tiny Llama generating 2 tokens from ``ids`` (``mask``: its attention mask),
    no probes, with DumpConfig ``options``."""
    model = build("llama", layers=4)
    with register_hook(model, DumpConfig(dump_path=str(folder), probes="none",
                                         **options)) as session, torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                       pad_token_id=0)
    return session.path


def assert_kept_positions_compared(kept: str, whole: str, n: int) -> None:
    """Either way round, a --tokens dump's prefill rows PASS against the whole dump's, at its
    ``n`` kept positions."""
    for mine, golden, side in ((kept, whole, "my"), (whole, kept, "the golden")):
        t = block_rows(compare(mine, golden).table)
        prefill = t[t["step"] == 0]
        assert (prefill["verdict"] == "PASS").all(), prefill[["layer", "cmp_fail_reason"]]
        assert prefill["cmp_fail_reason"].str.contains(
            f"the {n} token positions {side} dump kept").all()
        assert (t["verdict"] == "PASS").all()


def decoded(folder, tokens: list[int], steps: str = "0-2,7") -> str:
    """A tiny Llama fed a prompt then ``tokens`` one at a time through its KV cache (a
    generation whose tokens are given), captured at ``steps``."""
    model = build("llama", layers=4)
    with register_hook(model, DumpConfig(dump_path=str(folder), probes="none", steps=steps)
                       ) as session, torch.no_grad():
        out = model(input_ids=PROMPTS[0], use_cache=True)
        for token in tokens:
            out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return session.path


@pytest.mark.integration
def test_a_decode_step_after_other_tokens_at_steps_not_captured_is_not_compared(tmp_path):
    """Two generations that part at step 4 (not captured with --steps 0-2,7) and meet again on
    step 7's token: step 7's own input id agrees, its KV cache does not. It was compared as
    the same inputs, and its layer 0 named as the birth of the error."""
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    golden = decoded(tmp_path / "g", tokens)
    parted = decoded(tmp_path / "m", tokens[:4] + [99] + tokens[5:])
    t = block_rows(compare(parted, golden).table)
    by_step = t.groupby("step")["input_match"].agg(set).to_dict()
    assert by_step == {0: {"same"}, 1: {"same"}, 2: {"same"}, 7: {"differ"}}, by_step
    step7 = t[t["step"] == 7]
    assert (step7["verdict"] == "N/A").all()
    assert step7["cmp_fail_reason"].str.contains("at a step not captured").all(), \
        step7["cmp_fail_reason"].iloc[0]
    # the same tokens, the golden run captured at every step: step 7 is compared
    every = decoded(tmp_path / "all", tokens, steps="all")
    result = compare(decoded(tmp_path / "m2", tokens), every)
    t = block_rows(result.table)
    assert set(t.loc[t["step"] == 7, "input_match"]) == {"same"}
    assert (t.loc[t["step"] == 7, "verdict"] == "PASS").all()
    # the golden steps my --steps left out are said to be that ("no counterpart" before)
    left = result.table[result.table["step"].between(3, 6)]
    assert len(left) == 4 and left["cmp_fail_reason"].str.startswith(
        "step not kept in my dump: step ").all(), left["cmp_fail_reason"].tolist()
    # (step 8, after my last kept step 7, may be past my generation's end: no counterpart)
    assert result.summary.not_compared == {"step not kept in my dump": 4, "no counterpart": 1}
    # and a clean finding does not warn of them: they are the capture's choice
    assert result.summary.pattern == "clean" and "not compared" not in result.summary.message, \
        result.summary.message


def test_a_tokens_subset_is_compared_at_the_positions_it_kept(tmp_path):
    """--tokens -3: against a dump of every position (either side): the rows at the kept
    positions are compared, not called a shape mismatch; a fault there is still found."""
    whole = generated(tmp_path / "whole", PROMPTS[0])
    assert_kept_positions_compared(generated(tmp_path / "kept", PROMPTS[0], tokens="-3:"),
                                   whole, 3)
    faulty = generated(tmp_path / "fault", PROMPTS[0], tokens="-3:", inject=[FAULT])
    result = compare(faulty, whole)
    assert result.summary.first_layer == 2, result.summary.message


def test_a_tokens_subset_of_a_padded_batch_is_compared_at_the_positions_it_kept(tmp_path):
    """A left-padded batch of two prompts (a black-box user's evaluation script): every
    prefill of a --tokens dump was "shape mismatch" against the whole dump, since its rows
    have padding to leave out; now the kept positions are compared, padding left out on
    either side, and a fault there is still found."""
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # the shorter prompt, padded on the left
    ids[1, :5] = 0
    whole = generated(tmp_path / "whole", ids, mask)
    for tokens in ("0:8", "-8:"):
        kept = generated(tmp_path / tokens.replace(":", "_"), ids, mask, tokens=tokens)
        assert_kept_positions_compared(kept, whole, 8)
    faulty = generated(tmp_path / "fault", ids, mask, tokens="0:8", inject=[FAULT])
    result = compare(faulty, whole)
    assert result.summary.first_layer == 2, result.summary.message


def test_a_clean_finding_says_how_many_rows_were_not_compared(tmp_path, runs):
    """Rounds one side lacks are not compared: a PASS finding says so, not only the count."""
    two = capture(tmp_path / "two", prompts=PROMPTS[:2])
    message = compare(two, runs["golden"]).summary.message
    assert message.startswith("every compared layer PASSes"), message
    # the row is a whole round, every layer of it (a killed run's 6 read as "6 rows")
    assert "; but 1 round (every layer of it) was not compared (a sample only one dump " \
        "holds: 1 round; see cmp_fail_reason)" in message, message
    assert "my sample 1 is not in the golden dump" in " ".join(
        compare(two, runs["golden"]).table["cmp_fail_reason"].fillna(""))


def test_a_golden_dump_of_one_layers_modules_names_the_first_sub_layer_beyond_tolerance(
        tmp_path):
    """A golden dump of one layer's outputs and its sub-layers' (msprobe's level mix with a
    list of one layer, data_mode output: no block input): where the block output is beyond
    tolerance, the first sub-layer beyond it after sub-layers that agree is named (was "born
    there or before it; dump the layers before it")."""
    from srdd_dump.format.writer import DumpWriter, Round, Tensor

    rng = np.random.default_rng(0)
    sites = ["model.layers.1.self_attn", "model.layers.1.mlp"]

    def dump(path, layers, outputs):
        writer = DumpWriter(str(path), {"rank": 0, "pid": 1}, layers, sites)
        for sample, tensors in enumerate(outputs):
            writer.submit(Round(sample=sample, step=0, batch=1, seq=6, positions=np.arange(6),
                                token_ids=np.arange(6).reshape(1, 6) + sample,
                                tensors=[Tensor(layer, x, "float32", site=site)
                                         for (layer, site), x in tensors.items()]))
        return writer.close()

    golden_rounds, my_rounds = [], []
    for _ in range(3):
        attn, mlp, block = (rng.standard_normal((1, 6, 16)).astype(np.float32)
                            for _ in range(3))
        golden_rounds.append({(0, 0): attn, (0, 1): mlp, (0, s.BLOCK_SITE): block})
        off = rng.standard_normal((1, 6, 16)).astype(np.float32) * 0.3  # a fault in the MLP
        my_rounds.append({(0, s.BLOCK_SITE): rng.standard_normal((1, 6, 16)).astype(
            np.float32), (1, 0): attn, (1, 1): mlp + off, (1, s.BLOCK_SITE): block + off})
    golden = dump(tmp_path / "golden.h5", ["model.layers.1"], golden_rounds)
    mine = dump(tmp_path / "mine.h5", ["model.layers.0", "model.layers.1"], my_rounds)
    result = compare(mine, golden)
    summary = result.summary
    assert (summary.first_layer, summary.first_site) == (1, "model.layers.1.mlp"), \
        summary.message
    assert summary.message.startswith("error born inside layer 1 (model.layers.1): in 3 of 3 "
                                      "compared rounds model.layers.1.self_attn agree")
    assert result.sites.loc[result.sites["module"] == "model.layers.1.mlp",
                            "first_divergence"].all()


def test_a_birth_in_one_round_only_is_said_by_the_finding_that_does_not_name_it(tmp_path):
    """A layer that grows the error past tolerance in one round of three is marked
    first_divergence on that row, but too rare for the finding to name: the finding says both,
    so the table's marks and the summary do not read as two answers."""
    rng = np.random.default_rng(1)
    golden, mine = [], []
    for k in range(3):
        xs = {layer: rng.standard_normal((1, 8, 32)) for layer in (-1, 0, 1, 2)}
        golden.append(xs)
        mine.append({layer: x * (1 + (1e-3 if (k, layer) in ((0, 1), (0, 2)) else 1e-7))
                     for layer, x in xs.items()})
    g = write_dump(str(tmp_path / "golden.h5"), golden)
    m = write_dump(str(tmp_path / "mine.h5"), mine)
    result = compare(m, g)
    marked = result.table[result.table["first_divergence"]]
    assert list(marked["layer"]) == [1] and result.summary.first_layer is None
    assert "; first_divergence marks layer 1 (model.layers.1) in 1 of 3 rounds only" in \
        result.summary.message, result.summary.message


# -- (a) a small fault inside one layer's MLP --------------------------------------------------


def test_fault_in_one_mlp_is_the_first_divergence(runs):
    result = compare(runs["fault"], runs["golden"])
    t = result.table
    assert list(t.columns) == BASELINE_COLUMNS
    assert list(t["layer"]) == [-1, 0, 1, 2, 3]  # layer order, stack input first
    assert list(t["verdict"]) == ["PASS", "PASS", "PASS", "FAIL", "FAIL"]
    assert list(t.loc[t["first_divergence"], "layer"]) == [2]
    assert list(t["highlight"]) == ["", "", "", "red", ""]
    # The fault is small: every output still looks plausible (cosine far above msprobe's 0.99).
    assert t["cosine_similarity"].min() > 0.9999
    assert set(t["input_match"]) == {"same"}
    row = t[t["layer"] == 2].iloc[0]
    assert row["error_amplification"] > 1000  # its input agreed exactly
    assert row["module"] == row["golden_module"] == "model.layers.2"
    assert row["golden_dtype"] == row["my_dtype"] == "float32"
    assert row["golden_shape"] == row["my_shape"] == "[1, 16, 64]"
    assert row["cmp_fail_reason"] == ""
    summary = result.summary
    assert (summary.first_layer, summary.first_module) == (2, "model.layers.2")
    assert summary.pattern == "introduced" and "layer 2 (model.layers.2)" in summary.message
    assert summary.worst["layer"].iloc[0] == 2


def test_side_statistics_are_msit_columns(runs):
    t = compare(runs["fault"], runs["golden"]).table
    from srdd_dump.format.reader import DumpReader

    with DumpReader(runs["golden"]) as r:
        x = r.read(r.select(1)[0]).astype(np.float64)
    row = t[t["layer"] == 1].iloc[0]
    assert row["golden_max_value"] == x.max() and row["golden_min_value"] == x.min()
    assert row["golden_mean_value"] == pytest.approx(x.mean(), rel=1e-12)
    assert row["relative_euclidean_distance"] == 0 and row["sqnr"] == math.inf
    assert row["one_thousandth_err_ratio"] == row["five_thousandths_err_ratio"] == 1.0


# -- (b) bf16 against fp32: no single introducing layer ----------------------------------------


def test_bf16_against_fp32_has_no_introducing_layer(runs):
    result = compare(runs["bf16"], runs["golden"])
    t = result.table
    assert set(t["tolerance"]) == {"bfloat16"}
    assert set(t["verdict"]) <= {"PASS", "WARN"}
    assert not t["first_divergence"].any() and not (t["highlight"] != "").any()
    assert (t["error_amplification"] < 10).all()
    red = t["relative_euclidean_distance"].to_numpy()
    assert 0 < red[0] < red[-1]  # the rounding error accumulates along the stack
    assert t["cmp_fail_reason"].str.startswith("dtypes differ: golden float32, my bfloat16").all()
    assert result.summary.first_layer is None
    assert result.summary.pattern == "clean"  # docs/method.md: what the report says
    assert "bfloat16 tolerance" in result.summary.message

    # Judged at fp32 tolerance, the cast of the embedding output is what introduced the error.
    strict = compare(runs["bf16"], runs["golden"], thresholds=Thresholds(tolerance="float32"))
    assert list(strict.table.loc[strict.table["first_divergence"], "layer"]) == [-1]
    assert "stack input" in strict.summary.message


# -- (c) three cards, one faulty ---------------------------------------------------------------


@pytest.fixture(scope="module")
def cards(tmp_path_factory):
    root = tmp_path_factory.mktemp("cards")
    for name, inject in (("card0", ()), ("card1", [FAULT]), ("card2", ())):
        capture(root / name, inject=inject, prompts=PROMPTS[:2])
    return root


def test_consistency_names_the_odd_card_and_its_first_layer(cards, tmp_path):
    files = find_dump_files(str(cards))
    result = check_consistency(files, str(cards))
    assert result is not None and len(result.groups) == 1 and len(result.groups[0]) == 3
    (odd,) = result.odd_sources
    assert odd.startswith("card1" + os.sep)
    row = result.summary.set_index("source").loc[odd]
    assert row["first_departing_layer"] == 2 and row["first_departing_module"] == "model.layers.2"
    t = result.table
    assert list(t.loc[t["first_departure"], "layer"]) == [2]
    assert set(t.loc[t["departs"], "source"]) == {odd}
    assert (t["rounds"] == 2).all()
    assert "odd card out: " + odd in result.messages[0] and "layer 2" in result.messages[0]
    assert "odd card out" in consistency_text(result)

    csv_paths = write_consistency(result, str(tmp_path / "r.csv"))
    assert [os.path.basename(p) for p in csv_paths] == [
        "r.consistency.csv", "r.consistency_summary.csv"]
    pd.testing.assert_frame_equal(
        pd.read_csv(csv_paths[0])[["source", "layer", "departs"]],
        t[["source", "layer", "departs"]].reset_index(drop=True))
    xlsx = tmp_path / "r.xlsx"
    openpyxl.Workbook().save(xlsx)  # an existing report keeps its sheets
    write_consistency(result, str(xlsx))
    wb = openpyxl.load_workbook(xlsx)
    assert wb.sheetnames == ["Sheet", "consistency", "consistency_summary"]
    # the whole compare's XLSX summary names the odd card as its terminal screen does
    from srdd_dump.compare import compare_path
    from srdd_dump.report import write_report

    full = compare_path(str(cards), progress=False)
    assert full.consistency is not None
    write_report(full, str(tmp_path / "full.xlsx"))
    summary = [c.value for c in openpyxl.load_workbook(tmp_path / "full.xlsx")["summary"]["A"]]
    assert any(isinstance(v, str) and "odd card out: " + odd in v for v in summary)


def test_consistency_needs_three_sources_with_the_same_inputs(cards, tmp_path):
    files = find_dump_files(str(cards))
    assert check_consistency(files[:2], str(cards)) is None
    other = capture(tmp_path / "other", prompts=PROMPTS[2:3])  # same model, other input
    assert check_consistency(files[:2] + [other]) is None


def test_another_model_of_the_same_layer_names_is_no_card_of_the_group(cards, tmp_path):
    """Qwen2 and Llama name their blocks alike (model.layers.N): a Qwen2 run on the same
    inputs next to two Llama cards is not a third card (it was named the odd card out)."""
    qwen = capture(tmp_path / "qwen", prompts=PROMPTS[:2], arch="qwen2")
    files = [f for f in find_dump_files(str(cards)) if "card1" not in f] + [qwen]
    assert check_consistency(files) is None


def test_two_cards_on_the_same_inputs_are_told_how_to_compare_them(cards, tmp_path):
    """Two ranks of the same inputs (data parallel on two cards): the check needs three, and the
    compare says so with the command that shows where the two part."""
    import shlex
    import shutil

    from srdd_dump.compare import compare_path

    for name in ("card0", "card1"):
        shutil.copytree(cards / name, tmp_path / name)
    result = compare_path(str(tmp_path), progress=False)
    assert result.consistency is None
    (note,) = [n for n in result.notes if "multi-card check needs 3" in n]
    words = shlex.split(note.split("to see where these two part: ")[1])
    assert words[0] == "srdd-compare" and words[2] == "--baseline"
    paired = compare(words[1], words[3])  # the command's comparison, as it would run it
    assert set(paired.table.loc[paired.table["first_divergence"], "layer"]) == {2}
    alone = compare_path(str(tmp_path / "card0"), progress=False)  # one card: nothing to say
    assert not any("multi-card" in n for n in alone.notes)


def test_runs_in_another_dtype_are_no_cards_of_the_group(tmp_path):
    rng = np.random.default_rng(0)
    base = {k: rng.standard_normal((1, 4, 8)).astype(np.float32) for k in (-1, 0, 1)}
    for name in ("a", "b", "c"):
        write_dump(str(tmp_path / f"{name}.h5"), [{k: v.copy() for k, v in base.items()}])
    write_dump(str(tmp_path / "d.h5"), [{k: v.copy() for k, v in base.items()}],
               dtype="bfloat16")
    result = check_consistency(find_dump_files(str(tmp_path)), str(tmp_path))
    assert result is not None and result.groups == [["a.h5", "b.h5", "c.h5"]]
    assert result.odd_sources == []


def test_consistency_flags_nan_on_one_card(tmp_path):
    rng = np.random.default_rng(0)
    base = [{k: rng.standard_normal((1, 4, 8)).astype(np.float32) for k in (-1, 0, 1)}]
    for name in ("a", "b", "c", "d"):
        rounds = [{k: v.copy() for k, v in base[0].items()}]
        if name == "c":
            rounds[0][1][0, 1, 3] = np.nan
        write_dump(str(tmp_path / f"{name}.h5"), rounds)
    result = check_consistency(find_dump_files(str(tmp_path)), str(tmp_path))
    assert result.odd_sources == ["c.h5"]
    t = result.table
    assert t.loc[t["first_departure"], ["source", "layer", "nan_inf"]].values.tolist() == [
        ["c.h5", 1, 1]]
    # --fail-on fault: the odd card out is a FAULT of the run, though no file's own layers are
    from srdd_dump.compare.results import CompareResult

    layers = pd.DataFrame({"verdict": ["NORMAL"]})
    assert CompareResult("x", layers, pd.DataFrame(), consistency=result).worst_verdict() \
        == "FAULT"
    assert CompareResult("x", layers, pd.DataFrame()).worst_verdict() == "NORMAL"


def test_a_dump_of_some_layers_pairs_its_stack_input_with_the_block_before(runs, tmp_path):
    """A hunt dump (--layers) starts at a later block: its stack input is the output of the
    golden run's block before that one, not the golden embedding output (a healthy run was
    once blamed on "the stack input" with cosine -0.01)."""
    model = build("llama", layers=4)
    cfg = DumpConfig(dump_path=str(tmp_path / "some"), probes="none", layers="model.layers.[23]")
    with register_hook(model, cfg) as session, torch.no_grad():
        for ids in PROMPTS[:1]:
            model(input_ids=ids)
    for mine, golden in ((session.path, runs["golden"]), (runs["golden"], session.path)):
        result = compare(mine, golden)
        t = result.table[result.table["verdict"] != NOT_COMPARED]
        assert set(t["verdict"]) == {"PASS"}, t[["layer", "golden_layer", "verdict"]]
        stack = t[(t["layer"] == -1) | (t["golden_layer"] == -1)]
        assert len(stack) == 1 and stack["relative_euclidean_distance"].iloc[0] == 0
        assert result.summary.pattern == "clean", result.summary.message


# -- (d) mismatched models ---------------------------------------------------------------------


def test_mismatched_layer_counts_give_rows_not_a_crash(runs, tmp_path):
    short = capture(tmp_path / "short", layers=3)
    result = compare(short, runs["golden"])
    t = result.table
    (note,) = [n for n in result.notes if "two models" in n]  # said, as the rows cannot
    assert "two models: LlamaForCausalLM (llama) of 3 layers here, LlamaForCausalLM (llama) " \
           "of 4 layers in the golden run;" in note, note
    assert not any("two models" in n for n in compare(runs["fault"], runs["golden"]).notes)
    assert len(t) == 5  # golden layer 3 kept, with the reason
    missing = t[t["layer"].isna()].iloc[0]
    assert missing["golden_layer"] == 3 and missing["verdict"] == "N/A"
    assert missing["cmp_fail_reason"].startswith("no counterpart: golden layer 3")
    assert missing["golden_shape"] == "[1, 16, 64]" and missing["my_shape"] == ""
    assert not math.isnan(missing["golden_max_value"])
    assert "N/A" not in set(t["verdict"][:4])  # the others are compared (other weights: FAIL)


def test_mismatched_widths_and_names_give_rows(tmp_path):
    rng = np.random.default_rng(1)
    golden = write_dump(str(tmp_path / "g" / "g.h5"),
                        [{k: rng.standard_normal((1, 4, 16)) for k in (-1, 0, 1)}],
                        names=["enc.0", "enc.1"])
    mine = write_dump(str(tmp_path / "m" / "m.h5"),
                      [{k: rng.standard_normal((1, 4, 8)) for k in (-1, 0, 1, 2)}],
                      names=["blocks.0", "blocks.1", "blocks.2"], dtype="float16")
    result = compare(mine, golden)
    t = result.table
    assert list(t["verdict"]) == ["N/A"] * 4
    paired = t[t["golden_layer"].notna()]
    assert list(paired["golden_module"]) == ["(stack input)", "enc.0", "enc.1"]  # by index
    assert paired["cmp_fail_reason"].str.startswith("shape mismatch: golden [1, 4, 16] vs my "
                                                    "[1, 4, 8]").all()
    assert t.iloc[-1]["cmp_fail_reason"].startswith("no counterpart: my layer 2 (blocks.2)")
    assert result.summary.pattern == "nothing"
    assert set(result.summary.not_compared) == {"shape mismatch", "no counterpart"}


# -- (e) NaN/Inf on one side -------------------------------------------------------------------


def test_nan_inf_on_one_side_is_flagged(tmp_path):
    rng = np.random.default_rng(2)
    rounds = [{k: rng.standard_normal((1, 4, 8)).astype(np.float32) for k in (-1, 0, 1, 2)}]
    golden = write_dump(str(tmp_path / "g.h5"), rounds)
    bad = [{k: v.copy() for k, v in rounds[0].items()}]
    bad[0][1][0, 2, 5] = np.nan
    bad[0][2][0, 0, 0] = np.inf
    bad[0][2][0, 2, 5] = np.nan
    mine = write_dump(str(tmp_path / "m.h5"), bad)
    t = compare(mine, golden).table
    assert list(t["verdict"]) == ["PASS", "PASS", "FAIL", "FAIL"]
    assert list(t["first_divergence"]) == [False, False, True, False]
    assert list(t["highlight"]) == ["", "", "red", "red"]  # msprobe: NaN/Inf rows are red
    assert list(t["my_nan_inf"]) == [0, 0, 1, 2] and list(t["golden_nan_inf"]) == [0] * 4
    assert t.iloc[2]["cmp_fail_reason"] == "NaN/Inf: golden 0, my 1, 1 positions differ"
    assert t.iloc[2]["cosine_similarity"] == pytest.approx(1.0)  # the finite rest agrees
    summary = compare(mine, golden).summary  # the finding and the worst layers say the NaN
    assert "(NaN/Inf: golden 0, my 1, 1 positions differ)" in summary.message
    assert "cosine" not in summary.message
    assert list(summary.worst["layer"]) == [1, 2, -1, 0]  # the FAIL rows first

    same = compare(mine, mine).table  # NaN at the same places on both sides: a warning
    assert list(same["verdict"]) == ["PASS", "PASS", "WARN", "WARN"]
    assert "same 1 positions" in same.iloc[2]["cmp_fail_reason"]


def test_injected_nan_in_a_real_model(runs, tmp_path):
    nan = capture(tmp_path / "nan", inject=["stuck_at@layer=1,site=mlp,value=nan"])
    t = compare(nan, runs["golden"]).table
    assert list(t.loc[t["first_divergence"], "layer"]) == [1]
    assert t.iloc[2]["my_nan_inf"] == 16 * 64 and t.iloc[2]["verdict"] == "FAIL"


# -- (f) different inputs ----------------------------------------------------------------------


def test_different_inputs_are_reported_not_compared(tmp_path):
    golden = capture(tmp_path / "g", prompts=[PROMPTS[0], PROMPTS[1]])
    mine = capture(tmp_path / "m", prompts=[PROMPTS[1], PROMPTS[2]])
    result = compare(mine, golden)
    t = result.table
    same = t[t["sample"] == 0]
    assert (same["golden_sample"] == 1).all()  # paired by the input hash, not by order
    assert set(same["input_match"]) == {"same"} and set(same["verdict"]) == {"PASS"}
    differ = t[t["sample"] == 1]
    assert (differ["golden_sample"] == 0).all()
    assert set(differ["input_match"]) == {"differ"} and set(differ["verdict"]) == {"N/A"}
    assert differ["cmp_fail_reason"].str.startswith("inputs differ").all()
    assert differ["cosine_similarity"].isna().all()
    assert result.summary.not_compared == {"inputs differ": 5}


def test_decode_steps_pair_by_step_and_track_the_inputs(tmp_path):
    golden = capture(tmp_path / "g", new_tokens=3, steps="all")
    mine = capture(tmp_path / "m", new_tokens=3, steps="all", inject=[FAULT])
    t = compare(mine, golden).table
    assert sorted(set(t["step"])) == [0, 1, 2]
    firsts = t[t["first_divergence"]]
    compared = t[t["verdict"] != "N/A"]
    assert set(firsts["layer"]) == {2}
    assert len(firsts) == len(compared.groupby("step"))


# -- (g) the CLI end to end --------------------------------------------------------------------

NO_TORCH = """
import sys
sys.modules["torch"] = None
from srdd_dump.cli.compare import run_command  # the command, in this process
sys.argv = ["srdd-compare", *{args!r}]
try:
    print("exit", run_command())
except SystemExit as e:
    print("exit", e.code)
"""


def test_cli_csv_end_to_end_without_torch(runs, tmp_path):
    out = tmp_path / "report.csv"
    code = NO_TORCH.format(args=[runs["fault"], "--baseline", runs["golden"], "-o", str(out)])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "exit 0" in proc.stdout
    assert "first divergence: layer 2 (model.layers.2)" in proc.stdout
    assert "(1 compared round)" in proc.stdout and "report.csv" in proc.stdout
    with open(out, newline="") as f:
        rows = list(csv.reader(f))
    header = rows[0]
    assert header == BASELINE_COLUMNS
    assert header[header.index("golden_dtype"):header.index("cmp_fail_reason") + 1] == MSIT_COLUMNS
    assert [r[header.index("first_divergence")] for r in rows[1:]] == [
        "False", "False", "False", "True", "False"]
    assert (tmp_path / "report.files.csv").exists()


def test_cli_xlsx_colours_summary_chart_and_gating(runs, tmp_path):
    out = tmp_path / "report.xlsx"
    proc = run_cli("srdd-compare", runs["fault"], "--baseline", runs["golden"], "-o", str(out),
                   "--fail-on", "fault", "-q", timeout=60)
    assert proc.returncode == 1 and proc.stdout == "" and proc.stderr == "", proc.stderr
    wb = openpyxl.load_workbook(out)
    assert wb.sheetnames == ["compare", "summary", "files", "sublayers"]
    ws = wb["compare"]
    header = [c.value for c in ws[1]]
    assert header == BASELINE_COLUMNS
    fills = [ws.cell(row=i, column=1).fill.fgColor.rgb for i in range(2, ws.max_row + 1)]
    assert fills[3] == "FFFFC7CE" and all(f != "FFFFC7CE" for k, f in enumerate(fills) if k != 3)
    assert ws.cell(row=2, column=header.index("sqnr") + 1).value == "inf"  # Excel has no Inf
    summary = {r[0].value: r[1].value for r in wb["summary"].iter_rows(min_row=2, max_col=2)
               if r[0].value}
    assert summary["first divergent layer"] == 2
    assert summary["first divergent module"] == "model.layers.2"
    assert summary["FAIL rows"] == 2
    with zipfile.ZipFile(out) as z:
        chart = [n for n in z.namelist() if n.startswith("xl/charts/chart")]
        assert len(chart) == 1
        xml = z.read(chart[0]).decode()
    assert xml.count("<lineChart>") == 2 and "cosine similarity" in xml
    assert "relative error" in xml and "'summary'!" in xml


def test_cli_errors_are_one_line_exit_2(runs, tmp_path):
    from typer.testing import CliRunner

    from srdd_dump.cli.compare import app

    cases = {
        ("--baseline", str(tmp_path / "nope")): "--baseline " + str(tmp_path / "nope"),
        ("--baseline", runs["golden"], "--cos-fail", "2"): "--cos-fail 2.0",
        ("--baseline", runs["golden"], "--rel-dist-warn", "0.1", "--rel-dist-fail", "0.01"):
            "--rel-dist-warn 0.1 is above",
        ("--baseline", runs["golden"], "-j", "0"): "--jobs 0",
        ("--baseline", runs["golden"], "--tolerance", "int8"): "--tolerance 'int8'",
        ("--cos-fail", "0.9"): "apply with --baseline only",
    }
    runner = CliRunner()
    for args, expected in cases.items():
        out = tmp_path / "r.csv"
        res = runner.invoke(app, [runs["fault"], "-o", str(out), *args])
        lines = res.output.strip().splitlines()
        assert res.exit_code == 2, (args, res.output)
        assert len(lines) == 1 and lines[0].startswith("srdd-compare: error: "), res.output
        assert expected in lines[0], (args, lines[0])
        assert not out.exists()


def test_report_escapes_formulas(tmp_path):
    rng = np.random.default_rng(3)
    rounds = [{k: rng.standard_normal((1, 2, 4)) for k in (-1, 0, 1)}]
    names = ['=HYPERLINK("http://x")', "@sum"]
    golden = write_dump(str(tmp_path / "g.h5"), rounds, names=names)
    mine = write_dump(str(tmp_path / "m.h5"), rounds, names=names)
    compare(mine, golden, output=str(tmp_path / "r.xlsx"))
    compare(mine, golden, output=str(tmp_path / "r.csv"))
    ws = openpyxl.load_workbook(tmp_path / "r.xlsx")["compare"]
    header = [c.value for c in ws[1]]
    modules = {ws.cell(row=i, column=header.index("module") + 1).value for i in (3, 4)}
    assert modules == {"'=HYPERLINK(\"http://x\")", "'@sum"}
    assert "'@sum" in (tmp_path / "r.csv").read_text()


# -- (h) metrics against hand-computed values --------------------------------------------------


def test_metrics_by_hand():
    g = np.array([1.0, 2.0, 0.0, -4.0, 1000.0])
    m = np.array([1.1, 2.0, 0.0, -3.0, 1003.0])
    gg = 1 + 4 + 16 + 1e6
    mm = 1.21 + 4 + 9 + 1003.0**2
    dd = 0.01 + 1 + 9
    assert M.cosine_similarity(g, m) == pytest.approx((1.1 + 4 + 12 + 1003e3) / math.sqrt(gg * mm))
    # |m/g - 1| where |g| > eps, else 0: [0.1, 0, 0, 0.25, 0.003]
    assert M.max_relative_error(g, m) == pytest.approx(0.25)
    assert M.mean_relative_error(g, m) == pytest.approx((0.1 + 0.25 + 0.003) / 5)
    assert M.max_absolute_error(g, m) == pytest.approx(3.0)
    assert M.mean_absolute_error(g, m) == pytest.approx((0.1 + 1 + 3) / 5)
    assert M.relative_euclidean_distance(g, m) == pytest.approx(math.sqrt(dd / gg))
    assert M.sqnr(g, m) == pytest.approx(20 * math.log10(math.sqrt(gg) / math.sqrt(dd)))
    # msprobe ratios: exact (2.0), both zero, and 0.003 <= 0.005 but not <= 0.001
    assert M.one_thousandth_err_ratio(g, m) == pytest.approx(2 / 5)
    assert M.five_thousandths_err_ratio(g, m) == pytest.approx(3 / 5)


def test_kl_divergence_by_hand_and_stable():
    z = 1 + math.e + math.e**2
    p = [1 / z, math.e / z, math.e**2 / z]
    q = [1 / (1 + 2 * math.e), math.e / (1 + 2 * math.e), math.e / (1 + 2 * math.e)]
    want = sum(a * math.log(a / b) for a, b in zip(p, q))
    assert M.kl_divergence(np.array([0.0, 1, 2]), np.array([0.0, 1, 1])) == pytest.approx(want)
    # softmax is shift invariant: huge values give the same, finite result
    big = M.kl_divergence(np.array([1000.0, 1001, 1002]), np.array([1000.0, 1001, 1001]))
    assert big == pytest.approx(want)
    assert M.kl_divergence(np.array([3.0, -1]), np.array([3.0, -1])) == 0.0  # clamped, exact


def test_metric_edge_cases():
    zero = np.zeros(4)
    one = np.ones(4)
    assert M.cosine_similarity(zero, zero) == 1.0  # msit: both all zero
    assert math.isnan(M.cosine_similarity(zero, one))
    assert M.relative_euclidean_distance(zero, one) == 0.0  # msit: |g| <= eps gives 0
    assert M.sqnr(one, one) == math.inf
    assert M.five_thousandths_err_ratio(zero, one) == 0.0  # msprobe: |m| / eps
    g = np.array([1.0, np.nan, np.inf, 2.0, 5.0])
    m = np.array([1.0, np.nan, -np.inf, np.nan, 5.5])
    check = M.nan_inf(g, m)
    assert (check.golden, check.mine, check.mismatched) == (2, 3, 2)
    stats = M.compare_arrays(g, m)
    assert stats.n == 2 and stats.max_absolute_error == pytest.approx(0.5)
    assert stats.golden.values() == (5.0, 1.0, pytest.approx(8 / 3))  # finite golden values


def test_streamed_blocks_equal_the_whole(monkeypatch):
    rng = np.random.default_rng(0)
    g = rng.standard_normal(5000) * 20
    m = g + rng.standard_normal(5000) * 0.1
    m[17] = np.nan
    whole = M.compare_arrays(g, m).metrics()
    monkeypatch.setattr(M, "BLOCK", 333)
    parts = M.compare_arrays(g, m).metrics()
    for name, value in whole.items():
        assert parts[name] == pytest.approx(value, rel=1e-9, abs=1e-15), name


def test_table_is_the_same_in_tiny_blocks(runs, monkeypatch):
    want = compare(runs["fault"], runs["golden"]).table
    monkeypatch.setattr(streaming, "BLOCK_ELEMENTS", 100)  # 1 row of 64 per block
    monkeypatch.setattr(M, "BLOCK", 50)
    got = compare(runs["fault"], runs["golden"]).table
    pd.testing.assert_frame_equal(got, want, rtol=1e-9)


# -- tolerance and matching --------------------------------------------------------------------


def test_thresholds_defaults_and_overrides():
    assert tolerance_dtype("float32", "bfloat16") == "bfloat16"
    assert tolerance_dtype("float16", "float32") == "float16"
    limits = Thresholds().limits("float32", "float32")
    assert (limits.rel_dist_warn, limits.rel_dist_fail, limits.cos_fail) == (1e-4, 1e-3, 0.99)
    assert Thresholds().limits("float32", "bfloat16").rel_dist_fail == 0.15
    forced = Thresholds(tolerance="float16", cos_fail=0.999).limits("float32", "float32")
    assert (forced.tolerance, forced.rel_dist_warn, forced.cos_fail) == ("float16", 2e-3, 0.999)
    low = Thresholds(rel_dist_fail=1e-5).limits("float32", "float32")
    assert low.rel_dist_warn == low.rel_dist_fail == 1e-5  # the pair stays ordered
    # the library names its fields; the CLI renders them as its options (tested with the CLI)
    with pytest.raises(UserError, match="max_abs_warn -1"):
        Thresholds(max_abs_warn=-1).validate()
    with pytest.raises(UserError, match="cos_warn 0.9 is below cos_fail 0.95") as caught:
        Thresholds(cos_warn=0.9, cos_fail=0.95).validate()
    assert caught.value.render(lambda f: f.upper()) == "COS_WARN 0.9 is below COS_FAIL 0.95"


def test_msprobe_style_limits_can_be_set(runs):
    t = compare(runs["bf16"], runs["golden"],
                thresholds=Thresholds(cos_fail=0.99, max_abs_fail=0.001)).table
    over = t["max_absolute_error"] > 0.001  # absolute: depends on the scale of the values
    assert over.any()
    assert list(t["verdict"]) == ["FAIL" if x else "PASS" for x in over]


def _rounds(hashes):
    rows = np.zeros(len(hashes), s.ROUND_DTYPE)
    for i, (sample, step, h) in enumerate(hashes):
        rows[i]["round"], rows[i]["sample"], rows[i]["step"], rows[i]["tokens_hash"] = (
            i, sample, step, h)
    return rows


def test_matching_rules():
    assert pair_layers(["a", "b", "c"], ["b", "a"]) == [(0, 1), (1, 0), (2, None)]
    assert pair_layers(["x.0", "x.1"], ["y.0", "y.1", "y.2"]) == [(0, 0), (1, 1), (None, 2)]
    assert pair_layers(["a", "c"], ["a", "b", "c"]) == [(0, 0), (None, 1), (1, 2)]
    mine = _rounds([(0, 0, 7), (1, 0, 8), (2, 0, 0)])
    golden = _rounds([(0, 0, 8), (1, 0, 9), (2, 0, 7), (3, 0, 5)])
    assert pair_samples(mine, golden) == [(0, 2), (1, 0), (2, 1), (None, 3)]
    # a prompt run twice here and once in the golden run pairs with it both times (the second
    # copy was "not in the golden dump"); twice on both sides, one to one
    mine = _rounds([(0, 0, 7), (1, 0, 8), (2, 0, 7)])
    golden = _rounds([(0, 0, 8), (1, 0, 7)])
    assert pair_samples(mine, golden) == [(0, 1), (1, 0), (2, 1)]
    golden = _rounds([(0, 0, 7), (1, 0, 8), (2, 0, 7)])
    assert pair_samples(mine, golden) == [(0, 0), (1, 1), (2, 2)]


# -- (i) -j 2 gives the same table as -j 1 -----------------------------------------------------


def test_jobs_two_gives_the_same_table(tmp_path):
    golden = capture(tmp_path / "g", prompts=PROMPTS[:2], new_tokens=2, steps="all")
    mine = capture(tmp_path / "m", prompts=PROMPTS[:2], new_tokens=2, steps="all",
                   inject=[FAULT])
    one = compare(mine, golden, jobs=1)
    two = compare(mine, golden, jobs=2)
    pd.testing.assert_frame_equal(one.table, two.table)
    assert len(one.table) == 2 * 2 * 5  # samples x steps (prefill, 1 decode) x layers


# -- the birth of an error (issue 16) -----------------------------------------------------------


def _generate_dump(path, inject=(), dtype=torch.float32, layers=8):
    model = build("llama", layers=layers, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    config = DumpConfig(dump_path=str(path), samples=2, inject=list(inject), progress=False,
                        probes="none", granularity="block")
    with register_hook(model, config), torch.no_grad():
        for n in (24, 31):
            model.generate(torch.randint(1, 128, (1, n), generator=gen), max_new_tokens=3,
                           do_sample=False, pad_token_id=0)
    return str(path)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    return _generate_dump(tmp_path_factory.mktemp("clean"))


@pytest.mark.parametrize("spec", ["noise@layer=3,site=mlp,m=0.004",
                                  "scale@layer=3,site=mlp,m=0.02,sparsity=0.05"])
def test_an_error_born_inside_tolerance_is_named(tmp_path, clean_run, spec):
    """Same model, same device: a small fault in one MLP keeps its own layer at PASS or WARN
    (no FAIL anywhere), the error is exactly 0 before it: the birth layer is named."""
    result = compare_baseline(_generate_dump(tmp_path, [spec]), clean_run)
    t, summary = result.table, result.summary
    assert FAIL not in set(t["verdict"])
    births = t[t["first_divergence"]]
    assert len(births) and set(births["layer"]) == {3}
    assert not t["first_fail"].any()
    before = t[(t["layer"] < 3) & (t["verdict"] != NOT_COMPARED)]
    assert (before["relative_euclidean_distance"] == 0).all()
    assert summary.pattern == "born" and summary.first_layer == 3
    assert "error born at layer 3 (model.layers.3)" in summary.message
    assert "from an exact input" in summary.message and "reaches WARN" in summary.message


def test_a_tiny_error_that_stays_within_tolerance_is_located_but_clean(tmp_path, clean_run):
    result = compare_baseline(_generate_dump(tmp_path, ["noise@layer=5,site=mlp,m=0.0001"]),
                              clean_run)
    assert result.summary.pattern == "clean" and not result.table["first_divergence"].any()
    assert "first differ at layer 5" in result.summary.message


def test_bf16_against_fp32_has_no_birth(tmp_path, clean_run):
    """Rounding accumulates: no layer multiplies the error by 10x, so no birth, also when a
    tighter WARN limit makes the later layers WARN: the finding stays 'gradual'."""
    bf16 = _generate_dump(tmp_path, dtype=torch.bfloat16)
    result = compare_baseline(bf16, clean_run)
    assert not result.table["first_divergence"].any()
    assert result.summary.pattern == "clean"
    assert "first differ" not in result.summary.message  # other dtypes: no exact-input rule
    tight = compare_baseline(bf16, clean_run, thresholds=Thresholds(rel_dist_warn=0.004))
    assert "WARN" in set(tight.table["verdict"])
    assert not tight.table["first_divergence"].any()
    assert tight.summary.pattern == "gradual", tight.summary.message
    assert "no layer multiplies the error by 10x" in tight.summary.message


def test_msprobe_metric_rules():
    """--metrics msprobe reproduces msprobe's get_relative_err / calc_relative_err_ratio: eps of
    the inputs' precision added to both sides where the golden value is 0, float32 arithmetic,
    a strict < (values from msprobe 26.2.0 itself: bench/peer_check.py)."""
    g = np.array([0.0, 1.0, 2.0, -4.0], dtype=np.float32)
    m = np.array([1e-4, 1.0, 2.0, -4.0], dtype=np.float32)
    eps = float(np.finfo(np.float32).eps)
    default, probe = M.compare_arrays(g, m), M.compare_arrays(g, m, rules="msprobe")
    assert default.max_relative_error == 0  # msit: |g| <= eps is left out
    expected = float((np.float32(1e-4) + np.float32(eps) - np.float32(eps)) / np.float32(eps))
    assert probe.max_relative_error == pytest.approx(expected, rel=1e-6)
    assert probe.one_thousandth_err_ratio == 0.75
    edge_g, edge_m = np.full(8, 1000.0, np.float32), np.full(8, 1001.0, np.float32)
    assert M.compare_arrays(edge_g, edge_m).one_thousandth_err_ratio == 1.0  # <= in float64
    assert M.compare_arrays(edge_g, edge_m, rules="msprobe").one_thousandth_err_ratio == 0.0
    assert default.euclidean_distance == pytest.approx(1e-4, rel=1e-6)
    nan_g = np.array([np.nan, 1.0, 2.0], dtype=np.float32)
    same = M.compare_arrays(nan_g, np.array([np.nan, 1.0, 2.0], np.float32), rules="msprobe")
    assert same.one_thousandth_err_ratio == 1.0  # equal NaN positions count as equal elements
    other = M.compare_arrays(nan_g, np.array([1.0, np.nan, 2.0], np.float32), rules="msprobe")
    assert math.isnan(other.max_relative_error) and math.isnan(other.one_thousandth_err_ratio)


def test_cli_metrics_option(runs, tmp_path):
    out = tmp_path / "r.csv"
    proc = run_cli("srdd-compare", runs["fault"], "--baseline", runs["golden"], "-o", str(out),
                   "--metrics", "msprobe", "--quiet")
    assert proc.returncode == 0, proc.stderr
    df = pd.read_csv(out)
    assert "euclidean_distance" in df.columns and "first_fail" in df.columns
    bad = run_cli("srdd-compare", runs["fault"], "--baseline", runs["golden"], "-o", str(out),
                  "--metrics", "mine")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "--metrics 'mine'" in bad.stderr


def _rounds_table(reds_per_round, dtype_mine="bfloat16", dtype_golden="float32"):
    """A baseline table of rounds x layers from RED values (bf16 tolerance limits)."""
    rows = []
    for sample, reds in enumerate(reds_per_round):
        for layer, red in enumerate(reds):
            verdict = "PASS" if red <= 1.5e-2 else "WARN" if red <= 0.15 else "FAIL"
            rows.append(dict(source="a", golden_source="b", sample=sample, golden_sample=sample,
                             step=0, layer=layer, golden_layer=layer, module=f"l.{layer}",
                             verdict=verdict, relative_euclidean_distance=red,
                             tolerance="bfloat16", input_match="same", golden_nan_inf=0,
                             my_nan_inf=0, my_dtype=dtype_mine, golden_dtype=dtype_golden,
                             cosine_similarity=1.0, cmp_fail_reason=""))
    return pd.DataFrame(rows)


@pytest.mark.unit
def test_a_birth_by_growth_must_recur_to_be_named():
    from srdd_dump.compare.divergence import mark_divergence, summarize

    smooth = [0.004, 0.006, 0.009, 0.013, 0.02, 0.03]  # accumulates to WARN, x1.5 per layer
    jump = [0.004, 0.001, 0.06, 0.07, 0.08, 0.09]  # x15 at layer 2 (0.06 over the floor 2^-8)
    once = mark_divergence(_rounds_table([jump] + [smooth] * 9))
    assert once["first_divergence"].sum() == 1  # marked in its round ...
    assert summarize(once).pattern == "gradual"  # ... but not named: it does not recur
    often = mark_divergence(_rounds_table([jump] * 4 + [smooth] * 6))
    summary = summarize(often)
    assert summary.pattern == "born" and summary.first_layer == 2 and summary.first_rounds == 4


@pytest.mark.unit
def test_a_sub_layer_birth_is_the_earliest_layer_not_the_one_most_often_past_tenfold():
    """A dead zone in layer 10's MLP of SmolLM2, bf16 against fp32 (a user's run): the MLP
    FAILs at x9.71 and x19.9 its block input's error in the two prefills; layer 12's MLP, fed
    that error, FAILs at x12 and x11. The birth is layer 10 (it counted only rounds past x10
    before, and named layer 12)."""
    from srdd_dump.compare.divergence import mark_divergence, summarize

    table = mark_divergence(_rounds_table([[0.004, 0.006, 0.009, 0.03, 0.035, 0.04]] * 2))
    sites = pd.concat([_site_rows(table, 10, [("FAIL", 9.71), ("FAIL", 19.9)]),
                       _site_rows(table, 12, [("FAIL", 12.0), ("FAIL", 11.0)])])
    summary = summarize(table, sites=sites)
    assert summary.pattern == "site" and summary.first_layer == 10, summary.message
    assert summary.first_site == "l.10.mlp" and summary.first_site_rounds == 2
    # and marked where a user filters for it: the site's FAIL rows, its block's rows
    from srdd_dump.compare.divergence import mark_site_birth

    sites = sites.assign(first_divergence=False).reset_index(drop=True)
    table = pd.concat([table, table[table["layer"] == 5].assign(layer=10, module="l.10")],
                      ignore_index=True)
    # layer columns are nullable: a site of no layer (a golden-only site) is no match
    sites = pd.concat([sites, sites.iloc[:1].assign(layer=pd.NA, verdict="N/A")],
                      ignore_index=True).astype({"layer": "Int64"})
    table = table.astype({"layer": "Int64"})
    table.loc[0, "layer"] = pd.NA
    mark_site_birth(summary, table, sites)
    assert sites.loc[sites["first_divergence"], "module"].tolist() == ["l.10.mlp"] * 2
    assert set(table.loc[table["first_divergence"], "layer"]) == {10}
    assert table["first_divergence"].sum() == 2  # its two rounds


@pytest.mark.unit
def test_a_sub_layer_birth_is_named_in_a_dump_of_that_layer_alone():
    """The hunt's dump of layer 10 alone (bf16) against a full fp32 golden run: its stack input
    (layer 9's output) WARNs with bf16 rounding, which alone reads "unlocated"; layer 10's MLP
    FAILs at x9.6 and x12.8 that input's error: the birth is named inside layer 10."""
    from srdd_dump.compare.divergence import mark_divergence, summarize

    rows = []
    for sample in range(2):
        for layer, red in ((-1, 0.0187), (10, 0.03)):
            rows.append(dict(source="a", golden_source="b", sample=sample, golden_sample=sample,
                             step=0, layer=layer, golden_layer=layer if layer >= 0 else 9,
                             module=f"l.{max(layer, 10)}", golden_module="",
                             verdict="WARN", cosine_similarity=0.999,
                             relative_euclidean_distance=red, tolerance="bfloat16",
                             input_match="same", my_dtype="bfloat16", golden_dtype="float32",
                             cmp_fail_reason="", golden_nan_inf=0, my_nan_inf=0))
    table = mark_divergence(pd.DataFrame(rows))
    assert summarize(table).pattern == "unlocated"
    summary = summarize(table, sites=_site_rows(table, 10, [("FAIL", 9.6), ("FAIL", 12.8)]))
    assert summary.pattern == "site" and summary.first_layer == 10, summary.message


def _site_rows(table, layer, verdicts_amps):
    """One mlp row per round at ``layer``: (verdict, error_amplification) per round."""
    rows = []
    for sample, (verdict, amp) in enumerate(verdicts_amps):
        rows.append(dict(source="a", golden_source="b", sample=sample, golden_sample=sample,
                         step=0, layer=layer, module=f"l.{layer}.mlp", golden_module="",
                         verdict=verdict,
                         error_amplification=amp, relative_euclidean_distance=0.18,
                         cosine_similarity=0.98, tolerance="bfloat16", cmp_fail_reason=""))
    return pd.DataFrame(rows)


@pytest.mark.unit
def test_a_sub_layer_birth_is_named_when_no_block_multiplies_the_error_tenfold():
    """bf16 against fp32 with a fault in layer 3's MLP whose error is of the size of the two
    setups' rounding difference: the block's error grows x3, below a block birth, while the
    MLP's output FAILs at x12 its block input's error (a user's dead zone in SmolLM2 did
    this). The finding names layer 3 and its MLP, and --fail-on fault fires."""
    from srdd_dump.compare.divergence import mark_divergence, summarize
    from srdd_dump.compare.results import BaselineResult

    table = mark_divergence(_rounds_table([[0.004, 0.006, 0.009, 0.03, 0.035, 0.04]] * 4))
    gradual = summarize(table)
    assert gradual.pattern == "gradual"
    # the message names the layer that grows the error most (x3.3 at layer 3), and does not
    # claim there is no fault: one growing the error less than 10x looks the same
    assert "at most x3.33 across one layer (layer 3," in gradual.message, gradual.message
    assert "reference-free report" in gradual.message
    summary = summarize(table, sites=_site_rows(table, 3, [("FAIL", 12.0)] * 3
                                                + [("FAIL", 6.0)]))
    assert summary.pattern == "site" and summary.first_layer == 3, summary.message
    # the rounds where it FAILs (x12, x12, x12, x6: the median x12)
    assert summary.first_site == "l.3.mlp" and summary.first_site_rounds == 4
    assert "error born inside layer 3 (l.3)" in summary.message
    result = BaselineResult("a", "b", table, pd.DataFrame(), summary, None)
    assert result.worst_verdict() == "FAULT"
    # not a finding: a WARN (within FAIL's limit), or a tenfold growth in one round only
    for rows in ([("WARN", 12.0)] * 4, [("FAIL", 12.0)] + [("FAIL", 3.0)] * 3):
        quiet = summarize(table, sites=_site_rows(table, 3, rows))
        assert quiet.pattern == "gradual", quiet.message
        assert BaselineResult("a", "b", table, pd.DataFrame(), quiet, None).worst_verdict() \
            == "SUSPECT"


def _sites(rows):
    """Site rows from (round, layer, name, verdict, error_amplification), in the order given
    (the order their outputs were made)."""
    return pd.DataFrame([dict(source="a", golden_source="b", sample=r, golden_sample=r, step=0,
                              layer=layer, module=f"l.{layer}.{name}", golden_module="",
                              verdict=verdict, error_amplification=amp,
                              relative_euclidean_distance=0.18, cosine_similarity=0.98,
                              tolerance="bfloat16", cmp_fail_reason="")
                         for r, layer, name, verdict, amp in rows])


@pytest.mark.unit
def test_a_rounds_later_fails_are_no_birth_and_one_round_is_said_not_named():
    """One prompt of SmolLM2, bf16 against fp32, a dead zone in layer 10's MLP (a user's run):
    in the prefill layer 10's MLP FAILs at x12.2 its block input's error and layers 12-14's
    MLPs, fed that error through the residual stream, at x18 (the block's relative error,
    dominated by the attention sink's row, looks back within tolerance there); decode step 1
    has layer 14's attention FAIL at x4.6. It named layer 14 ("FAILs in 2 of 3 rounds"):
    layer 14's prefill FAIL is downstream of layer 10's, and layer 10's one round is said."""
    from srdd_dump.compare.divergence import mark_divergence, summarize

    table = mark_divergence(_rounds_table([[0.004, 0.006, 0.009, 0.03, 0.035, 0.04]] * 3))
    sites = _sites([(0, 10, "mlp", "FAIL", 12.2), (0, 12, "mlp", "FAIL", 18.9),
                    (0, 13, "mlp", "FAIL", 17.8), (0, 14, "mlp", "FAIL", 17.5),
                    (1, 14, "self_attn", "FAIL", 4.64)])
    summary = summarize(table, sites=sites)
    assert summary.first_layer is None and summary.pattern == "gradual", summary.message
    assert ("layer 10's l.10.mlp FAILs with x12.2 its block input's error in 1 of 3 compared "
            "rounds only (the prefill;") in summary.message, summary.message
    # the same in every prompt's prefill: named, at layer 10
    sites = _sites([(r, layer, "mlp", "FAIL", amp) for r in range(3)
                    for layer, amp in ((10, 12.2), (12, 18.9), (14, 17.5))])
    summary = summarize(table, sites=sites)
    assert (summary.pattern, summary.first_layer, summary.first_site) == ("site", 10, "l.10.mlp")
    # the worst layers, where the error has grown, are not the finding's: said under them
    from srdd_dump.compare.results import BaselineResult
    from srdd_dump.report.terminal import baseline_text

    files = pd.DataFrame({"role": ["my", "golden"], "status": ["OK", "OK"]})
    longer = mark_divergence(_rounds_table([[0.004 * 1.2 ** k for k in range(16)]] * 3))
    summary = summarize(longer, sites=sites)
    assert summary.first_layer == 10
    text = baseline_text(BaselineResult("a", "b", longer, files, summary, None))
    assert "(the largest errors; the error is born at layer 10, the finding's, and grows in " \
        "the layers after it)" in text, text


@pytest.mark.unit
def test_an_absolute_limit_that_fails_every_site_still_names_the_one_that_grew():
    """--max-abs-fail 0.001 (msprobe's) against bf16 rounding fails nearly every row, the norm
    before the faulty MLP too: the site named is the MLP that grew the error tenfold, not the
    first FAIL of the layer."""
    from srdd_dump.compare.divergence import mark_divergence, summarize

    table = mark_divergence(_rounds_table([[0.004, 0.006, 0.009, 0.03, 0.035, 0.04]] * 3))
    rows = []
    for r in range(3):
        rows += [(r, layer, "input_layernorm", "FAIL", 1.1) for layer in (2, 10)]
        rows += [(r, 10, "mlp", "FAIL", 14.0), (r, 12, "mlp", "FAIL", 18.0)]
    summary = summarize(table, sites=_sites(rows))
    assert (summary.pattern, summary.first_layer, summary.first_site) == ("site", 10, "l.10.mlp")


@pytest.mark.unit
def test_exact_input_births_need_one_device():
    """bf16 on an NPU against bf16 on a GPU: layer 0 differs by rounding from an exactly equal
    input (the embedding lookup), then the error accumulates to WARN. Not a birth across
    devices; on one device (a clean run against a faulty one) it is."""
    from srdd_dump.compare.divergence import mark_divergence, summarize

    reds = [[0.0, 0.003, 0.005, 0.008, 0.012, 0.018, 0.025, 0.03]] * 4
    table = _rounds_table(reds, "bfloat16", "bfloat16")
    across = mark_divergence(table)
    assert not across["first_divergence"].any()
    assert summarize(across).pattern == "gradual"
    one = mark_divergence(table, {("a", "b"): True})
    assert set(one.loc[one["first_divergence"], "layer"]) == {1}
    assert summarize(one, {("a", "b"): True}).pattern == "born"
    # files that do not name their device (msprobe dumps): a block output equal bit for bit
    # on both sides shows one setup, so the error from it is born; rounding from layer 0 on
    # (the stack input exact, layer 0 already apart) is not
    unknown = {("a", "b"): False}
    assert summarize(mark_divergence(table, unknown), unknown).pattern == "born"
    apart = _rounds_table([[0.003, 0.005, 0.008, 0.012, 0.018, 0.025, 0.03]] * 4, "bfloat16",
                          "bfloat16")
    assert summarize(mark_divergence(apart, unknown), unknown).pattern == "gradual"


def test_cli_nothing_compared_is_an_error_after_the_report(tmp_path):
    """Dumps of other prompts or another model pair no row: the report is written and the
    command ends in one line and exit code 2 (not 0: --fail-on would pass a CI gate that
    compared nothing)."""
    rng = np.random.default_rng(3)
    golden = write_dump(str(tmp_path / "g" / "g.h5"),
                        [{k: rng.standard_normal((1, 4, 16)) for k in (-1, 0, 1)}])
    mine = write_dump(str(tmp_path / "m" / "m.h5"),
                      [{k: rng.standard_normal((1, 5, 16)) for k in (-1, 0, 1)}])
    out = tmp_path / "r.csv"
    proc = run_cli("srdd-compare", mine, "--baseline", golden, "-o", str(out), "--fail-on",
                   "fault", "-q")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("srdd-compare: error: nothing was compared (")
    assert len(proc.stderr.strip().splitlines()) == 1 and out.exists()


def test_an_incomplete_file_is_named_so_in_the_baseline_summary(tmp_path):
    """A .partial file (its process killed) is used, and the summary says it is incomplete,
    as the reference-free summary does."""
    from srdd_dump.report.terminal import baseline_text

    from dumpfactory import make_partial

    rng = np.random.default_rng(4)
    rounds = [{k: rng.standard_normal((1, 4, 16)) for k in (-1, 0, 1)}]
    golden = write_dump(str(tmp_path / "g" / "g.h5"), rounds)
    make_partial(write_dump(str(tmp_path / "m" / "m.h5"), rounds))
    text = baseline_text(compare(str(tmp_path / "m"), golden))
    assert "my dumps: " in text and "1 file, 0 skipped, 1 incomplete" in text


@pytest.mark.unit
def test_samples_of_other_prompt_lengths_are_not_compared_when_ids_are_unknown():
    """A golden dump that recorded no input ids (an msprobe dump of outputs only), samples
    paired by order: a prefill of another length is another prompt, so neither it nor the
    decode steps after it are compared (their decode rows were compared and failed)."""
    from srdd_dump.analysis.matching import DIFFER, SAME, UNKNOWN, pair_rounds
    from srdd_dump.format.schema import ROUND_DTYPE

    def rounds(seqs):
        out = np.zeros(len(seqs) * 2, dtype=ROUND_DTYPE)
        for i, seq in enumerate(seqs):
            for step in (0, 1):
                row = out[2 * i + step]
                row["round"], row["sample"], row["step"] = 2 * i + step, i, step
                row["batch"], row["seq"] = 1, seq if step == 0 else 1
        return out

    pairs = pair_rounds(rounds([40, 52]), rounds([40, 61]))
    states = {(p.sample, p.step): p.input_match for p in pairs}
    assert states == {(0, 0): UNKNOWN, (0, 1): UNKNOWN, (1, 0): DIFFER, (1, 1): DIFFER}
    assert SAME not in states.values()
    assert {p.reason for p in pairs if p.input_match == DIFFER} == {
        "prompts of other lengths (52 tokens here, 61 in the golden run; no input ids "
        "recorded)"}
    # a golden run dumped for its second prompt only (msprobe's "step": [1]): my second
    # sample pairs with it by its prefill's length (my first paired with it, and nothing was
    # compared); my first has no counterpart
    pairs = pair_rounds(rounds([40, 52]), rounds([52]))
    states = {(p.sample, p.golden_sample, p.step): p.input_match for p in pairs}
    assert states == {(0, None, 0): "", (0, None, 1): "", (1, 0, 0): UNKNOWN,
                      (1, 0, 1): UNKNOWN}


def test_one_compared_forward_names_the_layer_its_own_growth_points_to(runs, tmp_path):
    """msit and msprobe compare one forward: with one compared round, that round's growth is
    the evidence (two rounds are asked for only when there are two)."""
    mine = capture(tmp_path / "one", dtype=torch.bfloat16,
                   inject=["noise@layer=2,site=mlp,m=0.3"])
    summary = compare(mine, runs["golden"]).summary
    assert summary.rounds == 1
    assert summary.first_layer == 2 and summary.pattern in ("born", "introduced", "site")
    assert "layer 2 (model.layers.2)" in summary.message
    assert "an accumulation" not in summary.message
    # the healthy bf16 run of the same forward: no birth
    healthy = compare(runs["bf16"], runs["golden"]).summary
    assert healthy.first_layer is None and healthy.pattern in ("clean", "gradual")


def test_a_finding_quotes_what_was_measured_never_nan():
    """A side with statistics only (msprobe's task statistics) proves a relative error and
    no cosine: the finding says so instead of 'up to nan, cosine nan'."""
    from srdd_dump.compare.divergence import error_words

    both = pd.Series({"relative_euclidean_distance": 0.25, "cosine_similarity": 0.97})
    assert error_words(both, "up to ") == "relative error up to 0.25, cosine 0.970000"
    stats = pd.Series({"relative_euclidean_distance": 0.793, "cosine_similarity": np.nan})
    assert error_words(stats) == "relative error at least 0.793 (from the statistics)"
    none = pd.Series({"relative_euclidean_distance": np.nan, "cosine_similarity": np.nan})
    assert "nan" not in error_words(none)


def test_runs_batched_differently_say_so_not_other_prompts(runs, tmp_path):
    """The same two prompts run as one batch of 2 and one at a time: a batch's sequences pair
    by their position in it, so nothing pairs; the reason and the command's error say the
    batching differs, not that the model or the prompts do."""
    batched = capture(tmp_path / "batched", prompts=[torch.cat(PROMPTS[:2])])
    apart = capture(tmp_path / "apart", prompts=PROMPTS[:2])
    result = compare(batched, apart)
    reasons = set(result.table["cmp_fail_reason"])
    assert any("inputs differ, batched differently (batch 2 here, 1 in the golden run)" in r
               for r in reasons), reasons
    proc = run_cli("srdd-compare", batched, "--baseline", apart, "-o", str(tmp_path / "r.csv"))
    assert proc.returncode == 2
    assert "capture both runs with the same batching" in proc.stderr, proc.stderr
    assert "batch 1, as a serving engine's dump" in proc.stderr
    # the rows not compared are counted under the reason with its numbers, not "batch N"
    assert "batched differently (batch 2 here, 1 in the golden run)" in proc.stdout, proc.stdout


@pytest.mark.unit
def test_the_sub_layer_marked_in_a_birth_layer_is_the_one_that_breaks_tolerance():
    """vLLM against Hugging Face, a clamp in layer 3's MLP (a user's run): the input norm grows
    the two engines' rounding 14x and PASSes, the MLP FAILs 1.8e6x its input's error. The
    sub-layer marked is the MLP (the last candidate at or before the first site beyond
    tolerance), not the norm; with no site beyond tolerance, the first candidate."""
    from srdd_dump.compare.divergence import mark_divergence, mark_sites

    table = mark_divergence(_rounds_table([[1e-7, 1e-7, 1e-7, 0.2, 0.2, 0.2]],
                                          dtype_mine="float32"))
    table["tolerance"] = "float32"
    assert list(table.loc[table["first_divergence"], "layer"]) == [3]

    def sites(verdicts_reds):
        rows = [dict(source="a", golden_source="b", sample=0, golden_sample=0, step=0,
                     layer=3, module=f"l.3.{name}", golden_module="", verdict=verdict,
                     relative_euclidean_distance=red, cosine_similarity=1.0,
                     tolerance="float32", golden_nan_inf=0, my_nan_inf=0,
                     my_dtype="float32", golden_dtype="float32", cmp_fail_reason="")
                for name, verdict, red in verdicts_reds]
        return mark_sites(pd.DataFrame(rows), table)

    broken = sites([("input_layernorm", "PASS", 1.4e-6), ("self_attn", "PASS", 2e-7),
                    ("post_attention_layernorm", "PASS", 3e-7), ("mlp", "FAIL", 0.2)])
    assert broken.loc[broken["first_divergence"], "module"].tolist() == ["l.3.mlp"]
    within = sites([("input_layernorm", "PASS", 1.4e-6), ("self_attn", "PASS", 2e-7),
                    ("post_attention_layernorm", "PASS", 3e-7), ("mlp", "PASS", 4e-6)])
    assert within.loc[within["first_divergence"], "module"].tolist() == [
        "l.3.input_layernorm"]
    # a site beyond tolerance that grew the error less than tenfold, before the one that
    # did: the mark is not lost, it goes to the first candidate after it
    late = sites([("input_layernorm", "WARN", 8e-7), ("mlp", "FAIL", 0.2)])
    assert late.loc[late["first_divergence"], "module"].tolist() == ["l.3.mlp"]


@pytest.mark.unit
def test_uncompared_rows_count_a_stack_input_both_sides_hold():
    """The finding's 'but N rows were not compared' counts the stack input rows that both
    sides hold (inputs differ), as the summary's count does (a user saw 93 there and 90 in
    the finding); a stack input one side did not record stays said per row."""
    from srdd_dump.compare.divergence import _uncompared

    differ = "inputs differ: the input ids of this round are not those of the golden run"
    table = pd.DataFrame({
        "layer": [-1, 0, 1, -1], "verdict": ["N/A", "N/A", "PASS", "N/A"],
        "cmp_fail_reason": [differ, differ, "", "missing record: no my data for this layer "
                            "in this round"]})
    assert _uncompared(table).startswith("; but 2 rows were not compared (inputs differ: 2 "
                                          "rows;")
    lost = "no counterpart: golden sample 2 is not in my dump"
    table = pd.DataFrame({"layer": [None, None, -1], "verdict": ["N/A", "N/A", "N/A"],
                          "cmp_fail_reason": [lost, lost, differ]})
    assert _uncompared(table).startswith("; but 2 rounds (every layer of them) and 1 row were "
                                          "not compared (a sample only one dump holds: 2 "
                                          "rounds, inputs differ: 1 row;")


def test_unknown_input_ids_are_no_agreement_at_the_first_layer(tmp_path):
    """Dumps of block outputs only, without input ids (msprobe's data_mode output): a round
    where layer 0 already differs (the tokens changed, a step the golden run skipped) was
    'layer 0 introduced the error: its input agrees with the golden run', and outvoted the
    layer that did introduce it in the other rounds. Unknown ids agree with nothing."""
    from srdd_dump.format.writer import DumpWriter, Round, Tensor

    rng = np.random.default_rng(3)
    golden = [{k: rng.standard_normal((1, 8, 16)).astype(np.float32) for k in range(4)}
              for _ in range(3)]
    mine = [{k: v.copy() for k, v in r.items()} for r in golden]
    for k in (2, 3):  # layer 2 introduces the error in the first round ...
        mine[0][k] = mine[0][k] * 1.5
    for j in (1, 2):  # ... and the later rounds' tokens differ: layer 0 on already
        for k in range(4):
            mine[j][k] = rng.standard_normal((1, 8, 16)).astype(np.float32)

    def write(path, rounds):
        writer = DumpWriter(str(path), {"rank": 0, "pid": 1},
                            [f"model.layers.{i}" for i in range(4)])
        for i, tensors in enumerate(rounds):
            writer.submit(Round(sample=i, step=0, batch=1, seq=8, positions=np.arange(8),
                                token_ids=None,
                                tensors=[Tensor(k, v, "float32") for k, v in tensors.items()]))
        return writer.close(None)

    result = compare(write(tmp_path / "mine.h5", mine), write(tmp_path / "golden.h5", golden))
    message = result.summary.message
    assert result.summary.first_layer == 2, message
    assert message.startswith("layer 2 (model.layers.2) introduced the error"), message


@pytest.mark.unit
def test_a_site_beyond_tolerance_right_after_one_that_agrees_exactly_is_said():
    """msprobe's level mix: every block passes, but the MLP is WARN right after its norm and
    projections agree exactly. The finding was 'every compared layer PASSes' alone."""
    import pandas as pd

    from srdd_dump.compare.divergence import _site_after_exact

    names = ["post_attention_layernorm", "mlp.down_proj", "mlp", "next"]
    reds = [0.0, 0.0, 0.03, 0.04]
    verdicts = ["PASS", "PASS", "WARN", "WARN"]
    sites = pd.DataFrame({
        "source": "a", "golden_source": "b", "sample": 0, "golden_sample": 0, "step": 0,
        "layer": 7, "module": [f"model.layers.7.{n}" for n in names],
        "relative_euclidean_distance": reds, "cosine_similarity": 0.9995,
        "verdict": verdicts, "tolerance": "bfloat16", "golden_nan_inf": 0, "my_nan_inf": 0,
        "red_lower_bound": float("nan")})
    text = _site_after_exact(sites)
    assert text.startswith("; but inside layer 7, model.layers.7.mlp is beyond bfloat16 "
                           "tolerance (WARN, relative error 0.03"), text
    assert "(1 of 1 compared rounds)" in text
    # a site before it that does not agree exactly (two devices' rounding), or statistics
    # that prove no equality: nothing said
    assert _site_after_exact(sites.assign(relative_euclidean_distance=[1e-3, 1e-3, .03, .04])
                             ) == ""
    assert _site_after_exact(sites.assign(red_lower_bound=0.0)) == ""
    # the first site already beyond tolerance: the later one is not where the error appears
    assert _site_after_exact(sites.assign(verdict=["FAIL", "PASS", "WARN", "WARN"],
                                          relative_euclidean_distance=[.5, 0, .03, .04])) == ""


def test_two_sessions_of_one_process_are_not_called_cards(tmp_path):
    """register_hook twice in one program writes srdd_rank0_pid<N>.h5 and ..._1.h5: they are
    two sessions of one process, not two cards the multi-card check would want a third of."""
    from srdd_dump.compare import compare_path

    rounds = normal_rounds(np.random.default_rng(0))
    for name in ("srdd_rank0_pid77.h5", "srdd_rank0_pid77_1.h5"):
        write_dump(str(tmp_path / name), rounds, meta={"rank": 0, "pid": 77})
    result = compare_path(str(tmp_path), progress=False)
    (note,) = [n for n in result.notes if "to see where these two part" in n]
    assert "two capture sessions of one process (pid 77)" in note and "cards" not in note, note
    # two containers reuse a pid (often 1) in one mounted folder, not their host names
    for host, name in (("a1", "srdd_rank0_pid1.h5"), ("b2", "srdd_rank0_pid1_1.h5")):
        write_dump(str(tmp_path / "docker" / name), rounds,
                   meta={"rank": 0, "pid": 1, "host": host})
    result = compare_path(str(tmp_path / "docker"), progress=False)
    (note,) = [n for n in result.notes if "to see where these two part" in n]
    assert "multi-card check needs 3" in note, note


@pytest.mark.unit
def test_a_cosine_just_below_one_never_prints_as_one():
    """The terminal's worst-layers table: a WARN row's cosine of 0.99999997 read 1.000000."""
    from srdd_dump.report.terminal import cosine_text

    assert cosine_text(0.99999997) == "0.99999997"
    assert cosine_text(1.0) == "1.000000"
    assert cosine_text(0.98765432) == "0.987654"
    assert cosine_text(float("nan")) == "nan"
    assert cosine_text(0.9999999999999) == "0.9999999999999"  # was "1."
    # the gap to 1 in two significant digits, not every digit of the float
    assert cosine_text(0.9999999999953928) == "0.9999999999954"


def test_two_runs_of_the_same_ranks_in_one_folder_are_both_compared(tmp_path):
    """Code writes its dumps into the dump path itself, so a torchrun program run twice leaves
    two files per rank in one folder. The baseline paired one file per rank (by name order, the
    older run) and skipped the others as "no golden dump file left": the faulty rank's file of
    the newer run was skipped, the finding read PASS and --fail-on fault exited 0. Each of mine
    is compared with the golden file of its rank; the finding names the one card of several
    whose rounds hold the birth; a golden folder holding two runs pairs by shared inputs."""
    rng = np.random.default_rng(5)
    golden = {rank: [{k: rng.standard_normal((1, 8, 16)).astype(np.float32) for k in range(4)}
                     for _ in range(3)] for rank in (0, 1)}
    ids = {rank: [np.full((1, 8), 10 * rank + i) for i in range(3)] for rank in (0, 1)}
    faulty = [{k: (v * 1.5 if k >= 2 else v.copy()) for k, v in r.items()} for r in golden[1]]
    for rank in (0, 1):
        write_dump(str(tmp_path / "golden" / f"srdd_rank{rank}_pid{rank + 5}.h5"), golden[rank],
                   meta={"rank": rank, "pid": rank + 5}, token_ids=ids[rank])
        # the older run (healthy) sorts first by name; the newer one's rank 1 is faulty
        write_dump(str(tmp_path / "mine" / f"srdd_rank{rank}_pid3015{rank}.h5"), golden[rank],
                   meta={"rank": rank, "pid": 30150 + rank}, token_ids=ids[rank])
        write_dump(str(tmp_path / "mine" / f"srdd_rank{rank}_pid911{rank}.h5"),
                   faulty if rank else golden[0], meta={"rank": rank, "pid": 9110 + rank},
                   token_ids=ids[rank])
    result = compare(tmp_path / "mine", tmp_path / "golden")
    assert list(result.files["status"]) == ["ok"] * 6, result.files
    message = result.summary.message
    assert message.startswith("layer 2 (model.layers.2) introduced the error"), message
    assert "in 3 of 12 compared rounds" in message, message
    assert message.endswith("; the birth's 3 rounds all in srdd_rank1_pid9111.h5 (3 of its 3 "
                            "compared rounds; 3 other files compared)"), message
    (note,) = [n for n in result.notes if "more than one file of a rank" in n]
    assert note.startswith("my dumps hold more than one file of a rank (rank 0: "
                           "srdd_rank0_pid30150.h5, srdd_rank0_pid9110.h5; rank 1: "), note
    done = run_cli("srdd-compare", str(tmp_path / "mine"), "--baseline",
                   str(tmp_path / "golden"), "-o", str(tmp_path / "r.csv"), "--fail-on", "fault")
    assert done.returncode == 1, done.stderr
    # the golden side holding two runs of rank 0, one of other prompts: mine pairs with the
    # one of its own inputs, whichever name sorts first
    other = [{k: rng.standard_normal((1, 8, 16)).astype(np.float32) for k in range(4)}
             for _ in range(3)]
    write_dump(str(tmp_path / "golden" / "srdd_rank0_pid1.h5"), other,
               meta={"rank": 0, "pid": 1}, token_ids=[np.full((1, 8), 99 + i) for i in range(3)])
    result = compare(tmp_path / "mine" / "srdd_rank0_pid30150.h5", tmp_path / "golden")
    assert result.summary.pattern == "clean" and result.summary.rounds == 3, \
        result.summary.message
    assert result.files.set_index("source").loc["srdd_rank0_pid5.h5", "paired_with"] \
        == "srdd_rank0_pid30150.h5"
    # the golden files left out are said on the terminal, not only in the files table
    (left,) = [n for n in result.notes if "paired with no file of mine" in n]
    assert left == ("golden files srdd_rank0_pid1.h5 (rank 0), srdd_rank1_pid6.h5 (rank 1) "
                    "paired with no file of mine: not compared"), left
    # the golden folder given as mine too: a clean PASS that proves nothing, said so
    same = compare(tmp_path / "golden", tmp_path / "golden").notes
    assert any(n.startswith("my dumps and the golden ones are the same files (") and
               n.endswith("every layer agrees by construction; give --baseline the golden "
                          "run's dumps") for n in same), same
    assert not any("the same file" in n for n in result.notes)
    # a rank the golden side lacks: compared with the golden file sharing its prompts, said so
    write_dump(str(tmp_path / "rank2" / "srdd_rank2_pid7.h5"), golden[1],
               meta={"rank": 2, "pid": 7}, token_ids=ids[1])
    result = compare(tmp_path / "rank2", tmp_path / "golden")
    (note,) = [n for n in result.notes if "no file of my rank" in n]
    assert "srdd_rank2_pid7.h5 (rank 2) with srdd_rank1_pid6.h5 (rank 1)" in note, note
    assert not [n for n in compare(tmp_path / "mine", tmp_path / "golden").notes
                if "no file of my rank" in n]
