"""Reference-free diagnosis on tiny random models with planted faults (exact evidence) and on
healthy models (no FAULT)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.analysis.diagnosis import FAULT, NORMAL, diagnose, relative_z, robust_z

from capture_utils import run_cli
from dumpfactory import compare_written as compare_path
from tiny_models import ARCHS, build

pytestmark = pytest.mark.integration


def _diagnose(tmp_path, arch="llama", inject=(), layers=6, dtype=torch.float32,
              granularity="sublayer", **cfg):
    model = build(arch, layers=layers, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    cfg = DumpConfig(dump_path=str(tmp_path), granularity=granularity, inject=list(inject),
                     **cfg)
    with register_hook(model, cfg), torch.no_grad():
        for n in (24, 31):
            model(input_ids=torch.randint(0, 128, (1, n), generator=gen))
    return compare_path(str(tmp_path), progress=False)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_healthy_models_get_no_fault(arch, dtype, tmp_path):
    result = _diagnose(tmp_path, arch, dtype=dtype)
    assert FAULT not in set(result.layers["verdict"]), result.layers[["layer", "evidence"]]
    assert "no faulty layer" in result.headlines[0]


@pytest.mark.parametrize("spec, family", [
    ("dead_zone@layer=3,m=0.3", "DEAD_ZONE"),
    ("dead_zone@layer=4,m=0.3,sparsity=0.1,site=mlp", "DEAD_ZONE"),
    ("mxfp4_deadzone@layer=2,site=attn", "DEAD_ZONE"),
    ("saturation@layer=1,m=0.3", "SAT_SOURCE|PILEUP_SAT"),
    ("saturation@layer=5,m=0.3,sparsity=0.1,site=mlp", "SAT_SOURCE|PILEUP_SAT"),
    ("noise@layer=0,m=0.3", "NOISE_SOURCE"),
    ("noise@layer=2,m=0.05,sparsity=0.1,site=attn", "NOISE_SOURCE"),
    ("nondeterminism@layer=4,m=0.3", "NOISE_SOURCE"),
    ("spike@layer=5,m=0.3", "SPIKE"),
    ("stuck_at@layer=2,sparsity=0.1,value=0.5", "STUCK"),
    ("precision@layer=3,dtype=bfloat16,site=mlp", "PRECISION"),
    ("precision@layer=2,dtype=float16,site=mlp", "PRECISION"),  # fp32 computed in fp16
    ("precision@layer=4,dtype=float16", "PRECISION"),
    ("bitflip@layer=1,rate=0.01,bits=exponent", "SPIKE|OVERFLOW"),
])
def test_planted_fault_is_named(spec, family, tmp_path):
    result = _diagnose(tmp_path, inject=[spec])
    layer = int(spec.split("layer=")[1].split(",")[0])
    top = result.layers.iloc[0]
    assert top["layer"] == layer, result.layers[["layer", "verdict", "evidence"]].head()
    assert top["verdict"] == FAULT
    assert set(family.split("|")) & set(top["diagnosis"].split(",")), top["evidence"]
    assert f"Layer {layer} (" in result.headlines[0] and "FAULT" in result.headlines[0]


@pytest.mark.parametrize("spec", [
    "dead_zone@layer=2,m=2",  # the whole output flushed: the later layers run on zeros
    "stuck_at@layer=2",  # the whole output one value: the later layers run on a constant
    "bitflip@layer=2,rate=0.01,bits=exponent",  # NaN and Inf: later norms output zeros
])
def test_a_fault_that_breaks_every_later_input_is_one_fault(spec, tmp_path):
    """Zeros, a constant or NaN carried from one block reach every later one, whose probes
    cannot perturb such an input (a noise in row stds) and whose norms turn a row holding an
    Inf into zeros: they are that source's propagation (SUSPECT, *_PROP), never FAULT rows or
    one shared kernel (SYSTEMIC)."""
    result = _diagnose(tmp_path, inject=[spec])
    layers = result.layers
    assert layers.iloc[0]["layer"] == 2 and layers.iloc[0]["verdict"] == FAULT, \
        layers[["layer", "verdict", "diagnosis"]]
    assert list(layers["verdict"]).count(FAULT) == 1, layers[["layer", "verdict", "diagnosis"]]
    assert not layers["diagnosis"].fillna("").str.contains("SYSTEMIC").any()
    later = layers[layers["layer"] > 2]
    assert later["diagnosis"].fillna("").map(
        lambda d: all(f.endswith("_PROP") for f in d.split(",") if f)).all(), later
    if spec.startswith("stuck_at"):  # said as what it is: a constant, not a clip
        assert "the output ignores its input: a constant" in layers.iloc[0]["evidence"]


@pytest.mark.parametrize("spec", ["scale@layer=2,m=1e21", "scale@layer=2,m=1e20"])
def test_values_past_a_norms_range_are_an_overflow_at_their_source(spec, tmp_path):
    """Finite values whose squares summed over a row overflow float32 (~1e19 and up): the
    next norm outputs zeros; the source is an OVERFLOW FAULT, the later layers carry it."""
    layers = _diagnose(tmp_path, inject=[spec]).layers
    assert list(layers["verdict"]).count(FAULT) == 1, layers[["layer", "verdict", "diagnosis"]]
    top = layers.iloc[0]
    assert top["layer"] == 2 and "OVERFLOW" in top["diagnosis"].split(","), top


@pytest.mark.parametrize("first", ["stuck_at@layer=1", "dead_zone@layer=1,m=2"])
def test_a_later_fault_of_its_own_stays_a_fault_after_a_broken_input(first, tmp_path):
    """Zeros a layer's input did not have are its own, even after a block whose output its
    input does not move."""
    layers = _diagnose(tmp_path, inject=[first, "dead_zone@layer=4,m=0.3,site=mlp"]).layers
    verdict = dict(zip(layers["layer"], layers["verdict"]))
    if first.startswith("stuck_at"):  # its input a non-zero constant: the zeros are layer 4's
        assert verdict[1] == FAULT and verdict[4] == FAULT, layers[["layer", "verdict",
                                                                      "diagnosis"]]
    else:  # its input all zeros: nothing it outputs can be judged its own
        assert verdict[1] == FAULT and list(layers["verdict"]).count(FAULT) == 1


def test_an_activations_own_fault_is_not_blamed_on_a_linear_after_it(tmp_path):
    """An activation's input zeros were the largest of any linear of its layer (down_proj, run
    after it, included): an all-zero down_proj must not make its zeros inherited."""
    top = _diagnose(tmp_path, inject=["scale@layer=3,m=-1,site=mlp.act_fn"],
                    granularity="op").layers.iloc[0]
    assert top["layer"] == 3 and top["verdict"] == FAULT and top["site"].endswith("act_fn"), top


def test_first_and_last_layers_are_diagnosable(tmp_path):
    for layer in (0, 5):
        result = _diagnose(tmp_path / str(layer), inject=[f"dead_zone@layer={layer},m=0.3"])
        assert result.layers.iloc[0]["layer"] == layer
        assert result.layers.iloc[0]["verdict"] == FAULT


def test_diagnosis_without_probes_uses_clean_evidence(tmp_path):
    result = _diagnose(tmp_path, inject=["dead_zone@layer=2,m=0.3"], probes="none")
    assert result.layers.iloc[0]["layer"] == 2 and result.layers.iloc[0]["verdict"] == FAULT
    assert np.isnan(result.layers.iloc[0]["gain"])


def test_robust_z():
    v = np.array([1.0, 1.1, 0.9, 1.0, 5.0, np.nan])
    z = robust_z(v)
    assert z[4] > 10 and abs(z[0]) < 1 and z[5] == 0


def test_cli_explain_and_fail_on(tmp_path):
    model = build("llama", layers=4)
    cfg = DumpConfig(dump_path=str(tmp_path / "d"), inject=["dead_zone@layer=1,m=0.3"])
    with register_hook(model, cfg), torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 20)))
    res = run_cli("srdd-compare", str(tmp_path / "d"), "-o", str(tmp_path / "r.csv"),
                  "--explain", "--fail-on", "fault")
    assert res.returncode == 1
    assert "Layer 1 (model.layers.1): FAULT - dead zone" in res.stdout
    assert "evidence:" in res.stdout and "exact zeros" in res.stdout
    res = run_cli("srdd-compare", str(tmp_path / "d"), "-o", str(tmp_path / "r.csv"), "-q")
    assert res.returncode == 0
    res = run_cli("srdd-compare", str(tmp_path / "d"), "--fail-on", "sometimes")
    assert res.returncode == 2 and "--fail-on" in res.stderr


def test_healthy_report_says_normal_everywhere(tmp_path):
    result = _diagnose(tmp_path, "qwen2")
    assert set(result.layers["verdict"]) <= {NORMAL, "SUSPECT"}


def test_aqn_rules():
    import pandas as pd

    from srdd_dump.report.aqn import aqn_config, to_yaml

    layers = pd.DataFrame({
        "source": ["a"] * 5, "layer": range(5), "verdict": ["NORMAL"] * 4 + ["FAULT"],
        "gain": [1.0, 1.0, 0.5, 1.0, 0.5],  # median 1.0: layers 2 and 4 lose signal
        "kurtosis": [10.0, 10.0, 10.0, 20.0, 20.0],  # median 10: layers 3 and 4 saturate
        "instability": [0.0, 0.5, 0.0, 0.0, 0.0],  # layer 1 is already noisy
    })
    cfg = aqn_config(layers)["aqn"]
    assert cfg["layer_sigmas"] == {0: 0.05, 1: 0.025, 2: 0.075, 3: 0.075, 4: 0.1125}
    assert cfg["high_priority_layers"] == [2, 3, 4]
    text = to_yaml(aqn_config(layers))
    assert "high_priority_layers: [2, 3, 4]" in text and "fault_layers: [4]" in text


def test_cli_writes_aqn_config(tmp_path):
    model = build("llama", layers=4)
    with register_hook(model, DumpConfig(dump_path=str(tmp_path / "d"))), torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 20)))
    res = run_cli("srdd-compare", str(tmp_path / "d"), "-o", str(tmp_path / "r.xlsx"),
                  "--aqn-config", str(tmp_path / "aqn.yaml"))
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "aqn.yaml").read_text()
    assert "layer_sigmas:" in text and "base_sigma: 0.05" in text
    assert text.count("    ") >= 4  # one line per layer under layer_sigmas
    # named .json: JSON (YAML's comment line made it unreadable as JSON)
    res = run_cli("srdd-compare", str(tmp_path / "d"), "-o", str(tmp_path / "r.csv"), "-q",
                  "--aqn-config", str(tmp_path / "aqn.json"))
    assert res.returncode == 0, res.stderr
    loaded = json.loads((tmp_path / "aqn.json").read_text())
    assert loaded["aqn"]["base_sigma"] == 0.05 and len(loaded["aqn"]["layer_sigmas"]) == 4
    report = (tmp_path / "r.xlsx").read_bytes()
    for clash, out in (("r.xlsx", "r.xlsx"), ("r.files.csv", "r.csv")):  # never a report file
        res = run_cli("srdd-compare", str(tmp_path / "d"), "-o", str(tmp_path / out),
                      "--aqn-config", str(tmp_path / clash))
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert f"--aqn-config {tmp_path / clash}: a file of the report" in res.stderr
    assert (tmp_path / "r.xlsx").read_bytes() == report


def test_compare_names_the_odd_card_out(tmp_path):
    """Three cards ran the same model on the same inputs; one has a fault at layer 2."""
    from srdd_dump.report.terminal import diagnosis_text as summary

    for i, inject in enumerate([[], [], ["noise@layer=2,m=0.05"]]):
        model = build("llama", layers=4)
        cfg = DumpConfig(dump_path=str(tmp_path / f"card{i}"), probes="none", inject=inject)
        with register_hook(model, cfg), torch.no_grad():
            model(input_ids=torch.arange(20).reshape(1, 20))
    result = compare_path(str(tmp_path), str(tmp_path / "r.xlsx"), progress=False)
    assert result.consistency is not None
    text = summary(result)
    assert "odd card out: card2/" in text and "first at layer 2" in text
    import openpyxl

    assert "consistency" in openpyxl.load_workbook(tmp_path / "r.xlsx").sheetnames


def test_batch_wide_clip_limit_is_found_by_batch_dependence(tmp_path):
    """A clip limit taken over the whole batch makes one input's output depend on the other
    inputs; the in-batch replay shows it at the clipped extremes, and only at that layer."""
    result = _diagnose(tmp_path, inject=["saturation@layer=3,m=0.05"])
    top = result.layers.iloc[0]
    assert top["layer"] == 3 and top["verdict"] == FAULT, result.layers[["layer", "evidence"]]
    assert "SAT_SOURCE" in top["diagnosis"].split(",")
    assert "changes with the rest of its batch" in top["evidence"]
    others = result.layers[result.layers["layer"] != 3]
    assert not others["evidence"].str.contains("rest of its batch").any()


def test_per_sequence_faults_leave_the_batch_replay_alone(tmp_path):
    """A fault whose range is taken per sequence: the in-batch reference replays the clean
    output up to kernel rounding, on every layer."""
    from srdd_dump.analysis.diagnosis import BATCH_DEP
    from srdd_dump.compare import file_signals
    from srdd_dump.format.reader import find_dump_files

    _diagnose(tmp_path, inject=["saturation@layer=3,m=0.05,scope=sample"])
    (path,) = find_dump_files(str(tmp_path))
    signals = file_signals(path)
    deps = [g.batch_dep for g in signals]
    assert len(deps) > 6 and max(deps) < 0.1 * BATCH_DEP["float32"]
    # each module's width reaches its signals from its records (the batch-dependence limit
    # of a decode step reads the blocks')
    from srdd_dump.format.reader import DumpReader

    with DumpReader(path) as reader:
        hidden = int(reader.records["width"][reader.records["site"] == -1].max())
    assert {g.width for g in signals if g.site == -1} == {hidden}


@pytest.mark.unit
def test_an_8_bit_grid_is_told_from_every_float_format():
    """grid_rows: rows quantised to 8 bits and back (per row, per tensor, uint8 with a zero
    point) lie on an even grid; fp32, fp16, bf16 and fp8 rows, however coarse, do not."""
    from srdd_dump.analysis.array_stats import grid_rows

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 576)).astype(np.float32)
    per_row = np.abs(x).max(axis=1, keepdims=True) / 127
    per_tensor = np.abs(x).max() / 127
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    step8 = (hi - lo) / 255
    zero = np.rint(-lo / step8)
    grids = {
        "int8 per row": np.rint(x / per_row) * per_row,
        "int8 per tensor": np.rint(x / per_tensor) * per_tensor,
        "uint8 with a zero point": (np.clip(np.rint(x / step8) + zero, 0, 255) - zero) * step8,
    }
    for name, q in grids.items():
        assert grid_rows(q.astype(np.float32), "float32") == 1.0, name
        stored = torch.from_numpy(q.astype(np.float32))  # the model's dtype rounds the grid
        assert grid_rows(stored.half().float().numpy(), "float16") == 1.0, name
        assert grid_rows(stored.bfloat16().float().numpy(), "bfloat16") == 1.0, name
    assert grid_rows(np.rint(x * 20), "float32") == 0.0  # integer codes, not dequantised
    t = torch.from_numpy(x)
    floats = {
        "float32": (x, "float32"),
        "float16": (t.half().float().numpy(), "float16"),
        "bfloat16": (t.bfloat16().float().numpy(), "bfloat16"),
        "bfloat16 near 1": ((t * 0.01 + 1).bfloat16().float().numpy(), "bfloat16"),
        "fp8 e4m3": (t.to(torch.float8_e4m3fn).float().numpy(), "float32"),
    }
    for name, (rows, dtype) in floats.items():
        assert grid_rows(rows, dtype) == 0.0, name
    assert np.isnan(grid_rows(x[:, :32], "float32"))  # too few values to tell
    # a bf16 row of a tiny model's width (64) passes for a grid by chance (1.4% of rows): such
    # rows are not tested in bf16; 128 values are, and no healthy one of them is on a grid
    narrow = torch.from_numpy(rng.standard_normal((4000, 64)) * 0.02).bfloat16().float().numpy()
    assert np.isnan(grid_rows(narrow, "bfloat16"))
    assert grid_rows(narrow, "float16") == 0.0 and grid_rows(narrow, "float32") == 0.0
    wide = torch.from_numpy(rng.standard_normal((2000, 128)) * 0.02).bfloat16().float().numpy()
    assert all(grid_rows(wide[i:i + 8], "bfloat16") == 0.0 for i in range(0, 2000, 8))
    scale = np.abs(wide[:8]).max(axis=1, keepdims=True) / 127
    int8 = torch.from_numpy(np.rint(wide[:8] / scale) * scale)
    assert grid_rows(int8.bfloat16().float().numpy(), "bfloat16") == 1.0  # still found


@pytest.mark.unit
def test_clip_limit_places_hold_what_a_clip_clips_and_little_else():
    """at_clip_limit: a limit on a few channels leaves its clipped values at each channel's
    extreme, shared by several tokens, while other channels pass the limit in the same rows.
    Not there: a channel constant over the tokens (stuck), a channel spanning a few steps of
    its values' precision, a coarse grid's values (which lie anywhere), ties made by a
    repeated row."""
    from srdd_dump.analysis.array_stats import _levels, _spans, at_clip_limit, at_row_extreme

    rng = np.random.default_rng(1)
    x = rng.standard_normal((48, 576)).astype(np.float32)
    x[:, :58] = np.clip(x[:, :58], -1.5, 1.5)  # a tenth of the channels clipped
    clipped = np.abs(x[:, :58]) == np.float32(1.5)
    assert not at_row_extreme(x)[:, :58][clipped].any()  # larger values elsewhere in the row
    top, bottom = x[:, :58] == np.float32(1.5), x[:, :58] == np.float32(-1.5)
    shared = (top & (top.sum(axis=0) >= 2)) | (bottom & (bottom.sum(axis=0) >= 2))
    assert shared.sum() > 0.8 * clipped.sum()
    assert np.array_equal(at_clip_limit(x)[:, :58] & clipped, shared)  # one alone: no evidence
    x[:, 100] = 0.5  # stuck
    steps = rng.integers(-3, 4, 48)
    steps[:2], steps[2:4] = 3, -3  # ties at both ends
    x[:, 101] = 0.5 + steps * 2.0 ** -8  # 6 steps of its own precision (2^-8)
    steps = rng.integers(-10, 11, 48)
    steps[:2], steps[2:4] = 10, -10
    x[:, 102] = 0.5 + steps * 2.0 ** -8  # 20 steps
    found, extreme = at_clip_limit(x), at_row_extreme(x)
    assert not (found[:, 100:102] | extreme[:, 100:102]).any()
    assert found[:4, 102].all() and found[:, 102].sum() == np.isin(steps, (-10, 10)).sum()
    # the spans are ties()' levels: step at the top's magnitude for the top, the bottom's for it
    cols = [0, 101, 102, 300]
    up, down = _spans(x[:, cols], x[:, cols].max(axis=0), x[:, cols].min(axis=0))
    for j, c in enumerate(cols):
        col = x[:, c]
        assert up[j] == pytest.approx(_levels(col, col.max(), col.min()))
        assert down[j] == pytest.approx(_levels(-col, -col.min(), -col.max()))
    coarse = torch.from_numpy(x[:, 200:]).to(torch.float8_e4m3fn).float().numpy()
    assert at_clip_limit(coarse).mean() < 0.05  # a few extremes, not the grid's values
    alone = rng.standard_normal((8, 64)).astype(np.float32)
    row_top = alone.argmax(axis=0)
    c = next(c for c in range(64) if not at_row_extreme(alone)[row_top[c], c])
    twice = np.concatenate([alone, alone[row_top[c]:row_top[c] + 1]])  # its top row, repeated
    assert not at_clip_limit(twice)[row_top[c], c]


def test_a_norms_zeros_its_input_had_are_the_inputs_in_a_round_no_probe_replayed():
    """The only decode round is a sample after --probe-samples (no replay), and its token's
    embedding row holds exact zeros (a GGUF model's): the first norm passes them on. Its own
    zeros beyond its input's, or zeros its replay keeps, stay a dead zone."""
    from srdd_dump.analysis.signals import DECODE, Signals
    from srdd_dump.vocabulary import NORM

    def run(norm_zeros: float, input_zeros: float, flat_zero: float = float("nan")):
        signals = [Signals(layer=k, site=-1, module=f"model.layers.{k}", samples=1,
                           phase=DECODE, dtype="float32", zero_frac=input_zeros if k < 0 else 0.0,
                           n_values=576, offset=0.01, kurtosis=0.5) for k in range(-1, 4)]
        signals.append(Signals(layer=0, site=0, module="model.layers.0.input_layernorm",
                               samples=1, phase=DECODE, dtype="float32", role=NORM,
                               zero_frac=norm_zeros, n_values=576, flat_zero=flat_zero))
        verdicts = diagnose(signals, "float32", 4)
        return next(v for v in verdicts if v.layer == 0)

    assert run(norm_zeros=4 / 576, input_zeros=4 / 576).verdict == NORMAL
    assert run(norm_zeros=40 / 576, input_zeros=4 / 576).verdict == FAULT  # its own zeros
    assert run(norm_zeros=40 / 576, input_zeros=40 / 576, flat_zero=40 / 576).verdict == FAULT


def test_a_norms_zeros_are_suspect_at_most_without_its_input_or_a_probe():
    """An msprobe dump of the norms alone (no block outputs, no stack input, no probes): the
    first norm's zeros may be its input's (a GGUF model's embedding holds exact zeros), and
    nothing in the dump can tell: SUSPECT, saying why. With its input in the dump the zeros
    beyond the input's stay a FAULT."""
    from srdd_dump.analysis.signals import PREFILL, Signals
    from srdd_dump.analysis.verdicts import SUSPECT
    from srdd_dump.vocabulary import NORM

    def run(with_input: bool):
        signals = [Signals(layer=k, site=-1, module=f"model.layers.{k}", samples=1,
                           phase=PREFILL, dtype="float32", zero_frac=0.0, n_values=57600,
                           offset=0.01, kurtosis=0.5) for k in range(-1 if with_input else 5, 4)]
        signals.append(Signals(layer=0, site=0, module="model.layers.0.input_layernorm",
                               samples=1, phase=PREFILL, dtype="float32", role=NORM,
                               zero_frac=0.0112, n_values=57600))
        return next(v for v in diagnose(signals, "float32", 4) if v.layer == 0)

    alone = run(with_input=False)
    assert alone.verdict == SUSPECT
    assert any("its input is not in the dump" in e.text for e in alone.evidence)
    assert run(with_input=True).verdict == FAULT


def test_without_repeat_runs_the_exact_identities_are_suspect_at_most():
    """--repeats 0: a noise fault breaks causality and the batched replay like a mask bug would
    (fresh noise per call), and nothing measured that the layer is deterministic. The evidence
    stays, SUSPECT at most and saying why; with repeats that found the layer bit-stable it is
    a FAULT."""
    from srdd_dump.analysis.signals import Signals
    from srdd_dump.analysis.verdicts import SUSPECT

    def run(instability: float):
        signals = [Signals(layer=k, site=-1, module=f"model.layers.{k}", samples=1,
                           dtype="float32", n_values=4000, offset=0.01, kurtosis=0.5,
                           instability=instability, instab_changed=0.0)
                   for k in range(8)]
        signals[5].causal_broken, signals[5].causal_n = 1.0, 4000
        signals[5].causal_size = 0.1
        return next(v for v in diagnose(signals, "float32", 8) if v.layer == 5)

    assert run(0.0).verdict == FAULT
    unrepeated = run(float("nan"))
    assert unrepeated.verdict == SUSPECT
    assert "no repeat runs were made" in unrepeated.evidence[0].text


def test_a_decode_tokens_chance_offset_is_no_bias_a_constant_one_is():
    """BIAS is relative: the offset |mean(u)| / rms(u) of one layer against the others. One
    decode token of 576 channels has a mean of about 1/sqrt(576) = 0.04 of its rms by chance,
    so a layer whose three decode tokens happen to sit there (healthy SmolLM2 on a plain-text
    prompt reached z = 8.8 among layers whose other tokens had smaller means) is no evidence;
    a constant added to every element is, at decode as at the prefill."""
    from srdd_dump.analysis.signals import DECODE, PREFILL, LayerSignals
    from srdd_dump.analysis.verdicts import SUSPECT

    rng = np.random.default_rng(7)

    def layer(k: int, phase: str, tokens: int, shift: float, rounds: int = 3):
        acc = LayerSignals(k, -1, f"model.layers.{k}", phase)
        for _ in range(rounds):
            x = rng.standard_normal((1, tokens, 576))
            x -= x.mean(axis=-1, keepdims=True) * 0.7  # means smaller than chance, as measured
            acc.add((x + shift).astype(np.float32), "float32", 0, None, None, [])
        return acc.result()

    def verdicts(phase: str, tokens: int, shifts: dict[int, float]):
        signals = [layer(k, phase, tokens, shifts.get(k, 0.0)) for k in range(30)]
        return {v.layer: v for v in diagnose(signals, "float32", 30)}

    # a mean of 1.5 chance levels at one layer: nothing
    chance = verdicts(DECODE, 1, {22: 1.5 / np.sqrt(576)})
    assert all(v.verdict == NORMAL for v in chance.values()), [
        (k, v.verdict) for k, v in chance.items() if v.verdict != NORMAL]
    # a constant of 0.8 rms on every element of one decode token, or 0.1 rms in a prefill of
    # 40 tokens: a FAULT named BIAS
    for phase, tokens, shift in ((DECODE, 1, 0.8), (PREFILL, 40, 0.1)):
        found = verdicts(phase, tokens, {12: shift})
        assert found[12].verdict == FAULT and found[12].diagnosis.startswith("BIAS"), found[12]
        assert all(v.verdict not in (FAULT, SUSPECT) for k, v in found.items() if k != 12)


def test_copies_of_a_row_are_one_row_to_the_chance_level_of_the_offset():
    """A beam search feeds the prompt once per beam: its rows come twice, and a mean of them
    is no less a chance than one copy's (healthy SmolLM2 read SUSPECT BIAS at layer 24 with
    num_beams=2, NORMAL when sampling the same prompt)."""
    from srdd_dump.analysis.signals import LayerSignals

    x = np.random.default_rng(3).standard_normal((1, 12, 64)).astype(np.float32)

    def noise(rows: np.ndarray) -> float:
        acc = LayerSignals(0, -1, "model.layers.0")
        acc.add(rows, "float32", 0, None, None, [])
        return acc.result().offset_noise

    assert noise(np.concatenate([x, x])) == pytest.approx(noise(x))
    other = np.random.default_rng(4).standard_normal((1, 12, 64)).astype(np.float32)
    assert noise(np.concatenate([x, other])) == pytest.approx(noise(x) / np.sqrt(2))


def test_a_part_of_the_models_layers_is_no_sample_for_the_relative_offset():
    """The offset of one layer against the others' needs the model's layers: in a dump of
    some (--layers 'model.layers.2?'), neighbouring late layers share their offsets and a
    healthy one stood out (SUSPECT BIAS at SmolLM2's layer 24, z 6.2, NORMAL in the whole
    dump). There the relative test is SUSPECT at most (from a FAULT's z, as in a whole dump)."""
    from srdd_dump.analysis.signals import LayerSignals

    rng = np.random.default_rng(7)

    def layer(k: int, shift: float):
        acc = LayerSignals(k, -1, f"model.layers.{k}")
        x = rng.standard_normal((1, 40, 576))
        acc.add((x + shift).astype(np.float32), "float32", 0, None, None, [])
        return acc.result()

    from srdd_dump.analysis.verdicts import SUSPECT

    shifts = {12: 0.2, 20: 0.08}  # a planted bias (z 19); one at two thirds of a FAULT's z
    signals = [layer(k, shifts.get(k, 0.0)) for k in range(30)]
    whole = {v.layer: v for v in diagnose(signals, "float32", 30)}
    part = {v.layer: v for v in diagnose(signals, "float32", 30, whole=False)}
    assert whole[12].verdict == FAULT and whole[12].diagnosis.startswith("BIAS")
    # the text names its module (the row's offset column is the block's, a site's may differ)
    assert any(e.text.startswith("mean offset of the update of model.layers.12 ")
               for e in whole[12].evidence), whole[12].evidence
    # under a FAULT's z an offset is no evidence (a healthy model's late layers reach z 6.6)
    assert whole[20].verdict == NORMAL
    # a part: the planted bias still seen, SUSPECT at most; the one under a FAULT's z is not
    assert part[12].verdict == SUSPECT and part[12].diagnosis.startswith("BIAS")
    assert all(v.verdict == NORMAL for k, v in part.items() if k != 12)
    # three layers picked (--layers 'model.layers.1[0-2]'): no sample at all, no BIAS (the
    # layer after a planted bias, reacting to it, read z 32 among three and took the label)
    few = [signals[k] for k in (10, 11, 12)]
    few[2] = layer(12, 0.5)
    three = {v.layer: v for v in diagnose(few, "float32", 30, whole=False)}
    assert all("BIAS" not in v.diagnosis for v in three.values()), three


def test_a_norm_after_a_gap_in_the_blocks_has_no_known_input():
    """--layers 'model.layers.[013]': the block before layer 3 in the dump is layer 1, not its
    input. A norm's zeros were taken as layer 1's passed on (NORMAL); its input is not in the
    dump, so zeros it made cannot be told from zeros it was given: SUSPECT, said so."""
    from srdd_dump.analysis.signals import Signals
    from srdd_dump.analysis.verdicts import SUSPECT
    from srdd_dump.vocabulary import NORM

    def sig(layer: int, site: int, zeros: float, role: str = "") -> Signals:
        name = f"model.layers.{layer}" + ("" if site < 0 else ".post_attention_layernorm")
        return Signals(layer=layer, site=site, module=name, samples=1, dtype="float32",
                       zero_frac=zeros, n_values=40 * 576, role=role, kurtosis=0.0)

    signals = [sig(0, -1, 0.0), sig(1, -1, 0.6), sig(2, -1, 0.0), sig(2, 3, 0.6, NORM)]
    follows = {v.layer: v for v in diagnose(signals, "float32", 3)}
    gap = {v.layer: v for v in diagnose(signals, "float32", 3, after_gap=frozenset({2}))}
    assert follows[2].verdict == NORMAL
    assert gap[2].verdict == SUSPECT and gap[2].diagnosis.startswith("DEAD_ZONE")
    assert "its input is not in the dump" in gap[2].evidence[0].text


def test_a_small_share_of_elements_never_reads_as_none():
    """The clip-limit evidence quotes the share of elements the batch moved: a few elements of
    a large output are not '0.00%'."""
    from srdd_dump.analysis.diagnosis import _share

    assert _share(3.1e-5) == "0.0031%" and _share(0.0042) == "0.42%"
    assert _share(0.25) == "25.00%" and _share(0.0) == "0.00%"
    assert _share(0.00999) == "1.00%" and _share(1e-7) == "under 0.0001%"


def test_a_headline_says_which_evidence_the_fault_rests_on():
    """The headline names the main finding with its own evidence; when that is under the
    FAULT limit and a secondary evidence makes the verdict, it says the verdict rests on it
    (a new user read '(0.5x the FAULT limit); also ...' as a FAULT below its limit)."""
    from srdd_dump.analysis.diagnosis import Evidence, LayerVerdict, headline

    ties = Evidence("PILEUP_SAT", 0.5, "6 tokens share a channel's exact extreme",
                    module="model.layers.17.mlp")
    batch = Evidence("SAT_SOURCE", 33.3, "the output changes with the rest of its batch",
                     module="model.layers.17.mlp", secondary=True)
    v = LayerVerdict(17, "model.layers.17", 33.3, FAULT, "PILEUP_SAT,SAT_SOURCE",
                     [ties, batch], site="model.layers.17.mlp")
    line = headline(v)
    assert "(0.5x the FAULT limit); the verdict rests on the output changes" in line, line
    strong = Evidence("PILEUP_SAT", 2.0, "9 tokens share a channel's exact extreme",
                      module="model.layers.17.mlp")
    v.evidence = [strong, batch]
    assert "; also the output changes" in headline(v)


def test_a_headline_resting_on_a_reference_also_names_the_kind_of_fault():
    """A per-sequence clamp of an MLP's output (a user's Gemma 3 run): the reference MLP's
    mismatch is the strongest evidence, its words 'a fault inside one of its operators', and
    the clamp showed only as the second label. The headline says what the output looks like."""
    from srdd_dump.analysis.diagnosis import Evidence, LayerVerdict, headline

    mismatch = Evidence("MLP_MISMATCH", 241.0, "model.layers.11.mlp differs by 0.241",
                        module="model.layers.11.mlp")
    piled = Evidence("PILEUP_SAT", 3.0, "40 tokens share a channel's exact extreme",
                     module="model.layers.11.mlp")
    v = LayerVerdict(11, "model.layers.11", 241.0, FAULT, "MLP_MISMATCH,PILEUP_SAT",
                     [mismatch, piled], site="model.layers.11.mlp")
    line = headline(v)
    assert line.endswith("; what it looks like: saturation (values piled up at the extremes): "
                         "40 tokens share a channel's exact extreme (3x)"), line
    # another module's, or under SUSPECT: not said
    v.evidence = [mismatch, Evidence("PILEUP_SAT", 3.0, "x", module="model.layers.11")]
    assert "what it looks like" not in headline(v)
    v.evidence = [mismatch, Evidence("PILEUP_SAT", 0.3, "x", module="model.layers.11.mlp")]
    assert "what it looks like" not in headline(v)


def test_the_batch_dependence_limit_admits_one_dot_products_rounding():
    """A healthy fp32 SmolLM2 decode step: the attention's in-batch replay (5 rows, a matrix
    product) differed from its recorded one-row call (a matrix-vector product) by 6.4e-6 of
    max|x|, SUSPECT BATCH_DEP at 0.64x the 1e-5 limit. The limit is at least the worst-case
    rounding of a dot product of the layer's width (576 x 2^-24 = 3.4e-5); a batch-wide range
    moves far more and stays found."""
    from srdd_dump.analysis.diagnosis import batch_dep_limit
    from srdd_dump.analysis.signals import DECODE, PREFILL, Signals
    from srdd_dump.vocabulary import SUBLAYER

    assert batch_dep_limit("float32", 576) == 576 * 2.0**-24
    assert batch_dep_limit("float32", 0) == 1e-5  # width unknown: the dtype's limit
    assert batch_dep_limit("bfloat16", 576) == 3e-2  # a half type rounds the order away

    def labels(batch_dep: float, width: int, phase: str = DECODE, site_width: int = 576
               ) -> list[str]:
        signals = [Signals(layer=k, site=-1, module=f"model.layers.{k}", samples=1,
                           phase=phase, dtype="float32", n_values=576, offset=0.01,
                           kurtosis=0.5, instability=0.0, width=width) for k in range(4)]
        signals.append(Signals(layer=2, site=0, module="model.layers.2.self_attn", samples=1,
                               phase=phase, dtype="float32", role=SUBLAYER, n_values=576,
                               instability=0.0, batch_dep=batch_dep, batch_dep_level=0.1,
                               batch_dep_moved=0.5, width=site_width))
        verdict = next(v for v in diagnose(signals, "float32", 4) if v.layer == 2)
        return verdict.diagnosis.split(",") if verdict.diagnosis else []

    assert "BATCH_DEP" not in labels(6.4e-6, 576)
    assert "BATCH_DEP" in labels(6.4e-6, 0)  # the blocks' width unknown: the dtype's limit
    assert "BATCH_DEP" in labels(1e-3, 576)  # a batch-wide scale: found
    assert "BATCH_DEP" in labels(6.4e-6, 576, PREFILL)  # matrix products on both sides
    # an up_proj's output is 4x wider than what it sums over: the blocks' width counts
    assert "BATCH_DEP" in labels(6.4e-5, 576, site_width=4 * 576)


def test_a_models_own_late_layer_offsets_are_no_bias():
    """Healthy SmolLM2 (a black-box user's five 4-prompt runs): its late layers carry mean
    offsets of the update of 0.02-0.045 while the early layers' sit at 0.002-0.008 with a
    tight spread, so layer 24 read z 6.0-6.6 among all 30 and was SUSPECT BIAS in every run,
    a constant bias of 0.17 planted at layer 11 z 7.9: a z among layers under the FAULT's is
    no evidence."""
    from srdd_dump.analysis.signals import LayerSignals

    rng = np.random.default_rng(11)
    # the early layers' offsets tight, the late ones' spread upwards, one of them further
    offsets = [0.005 + 0.001 * rng.standard_normal() for _ in range(14)] + [
        0.012, 0.02, 0.018, 0.025, 0.01, 0.016, 0.02, 0.014, 0.022, 0.03, 0.05, 0.02, 0.012,
        0.008, 0.01, 0.015]

    def layer(k: int, offset: float):
        acc = LayerSignals(k, -1, f"model.layers.{k}")
        x = rng.standard_normal((1, 2000, 576))
        x = x - x.mean() + offset * x.std()
        acc.add(x.astype(np.float32), "float32", 0, None, None, [])
        return acc.result()

    signals = [layer(k, o) for k, o in enumerate(offsets)]
    z = relative_z(signals)["offset"]
    assert 6 <= z[24] < 12, z[24]  # SUSPECT's z before, under a FAULT's
    verdicts = {v.layer: v for v in diagnose(signals, "float32", 30)}
    assert all(v.verdict == NORMAL for v in verdicts.values()), [
        (v.layer, v.diagnosis) for v in verdicts.values() if v.verdict != NORMAL]
