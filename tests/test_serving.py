"""The diagnosis under the conditions NPU users run models in: generation with decode steps,
padded batches, autocast, a kernel shared by every layer, faults with absolute limits, and
evidence inherited by later layers. Tiny random Llama models, default capture options."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.analysis.diagnosis import FAULT, SUSPECT, diagnose
from srdd_dump.analysis.signals import DECODE, PREFILL, Signals
from srdd_dump.compare import compare_path
from srdd_dump.format.reader import DumpReader, find_dump_files
from srdd_dump.format.schema import KIND_MASK

from capture_utils import cpu_autocast_covers_attention
from tiny_models import build

pytestmark = [pytest.mark.integration, pytest.mark.capture]
LAYERS = 6
AUTOCAST = pytest.mark.skipif(not cpu_autocast_covers_attention(),
                              reason="this torch's CPU autocast leaves attention's inputs in "
                              "two dtypes: the program fails without capture too")


def _generate(tmp_path, inject=(), pad=False, autocast=False, dtype=torch.float32, **cfg):
    """Two prompts (a padded batch of two with ``pad``), greedy generation of 10 tokens."""
    model = build("llama", layers=LAYERS, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    config = DumpConfig(dump_path=str(tmp_path), inject=list(inject), progress=False, **cfg)
    with register_hook(model, config), torch.no_grad():
        for n in (24, 31):
            ids = torch.randint(1, 128, (2 if pad else 1, n), generator=gen)
            kwargs = {}
            if pad:  # left padding, as generate needs for a batch of unequal prompts
                mask = torch.ones_like(ids)
                mask[1, : n // 3] = 0
                ids[1, : n // 3] = 0
                kwargs["attention_mask"] = mask
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0,
                               **kwargs)
    return compare_path(str(tmp_path), progress=False)


def _top(result):
    return result.layers.iloc[0]


@pytest.mark.parametrize("case", ["plain", "left-padded batch",
                                  pytest.param("autocast bf16", marks=AUTOCAST), "bf16"])
def test_healthy_generation_has_no_fault(tmp_path, case):
    result = _generate(tmp_path, pad=case == "left-padded batch", autocast=case == "autocast bf16",
                       dtype=torch.bfloat16 if case == "bf16" else torch.float32)
    assert FAULT not in set(result.layers["verdict"]), result.layers[["layer", "evidence"]]
    assert (result.layers["verdict"] == SUSPECT).sum() <= 1
    assert set(result.sites["phase"]) == {PREFILL, DECODE}  # decode steps are probed too


def test_padded_rows_are_recorded_and_left_out(tmp_path):
    result = _generate(tmp_path, pad=True)
    (path,) = find_dump_files(str(tmp_path))
    with DumpReader(path) as r:
        masks = r.records[r.records["kind"] == KIND_MASK]
        prefill = [x for x in r.rounds if x["step"] == 0]
        assert len(masks) == len(prefill)  # decode steps of left-padded rows attend all
        keep = r.read(masks[0]).reshape(-1)
        assert keep.sum() == keep.size - 24 // 3  # the padded positions of the second row
    assert result.layers["zero_frac"].max() == 0


@pytest.mark.parametrize("spec, family", [
    ("dead_zone@layer=3,quantile=0.3,site=attn,phase=decode", "DEAD_ZONE"),
    ("noise@layer=2,m=0.05,site=attn,phase=decode", "NOISE_SOURCE"),
    ("saturation@layer=4,quantile=0.9,site=mlp,phase=decode", "SAT_SOURCE"),
    ("dead_zone@layer=1,limit=0.02,site=mlp", "DEAD_ZONE"),  # flush-to-zero at a fixed value
    ("saturation@layer=2,quantile=0.99,site=mlp", "SAT_SOURCE|PILEUP_SAT"),  # fp8-like clamp
])
def test_device_like_faults_are_named_with_default_options(tmp_path, spec, family):
    result = _generate(tmp_path, inject=[spec])
    layer = int(spec.split("layer=")[1].split(",")[0])
    top = _top(result)
    assert (top["layer"], top["verdict"]) == (layer, FAULT), result.layers.head()
    assert set(family.split("|")) & set(top["diagnosis"].split(",")), top["evidence"]
    assert (result.layers["verdict"] == FAULT).sum() == 1


def test_decode_only_fault_says_decode_in_the_headline(tmp_path):
    result = _generate(tmp_path, inject=["noise@layer=2,m=0.05,site=attn,phase=decode"])
    assert "(decode steps)" in result.headlines[0]


def test_a_decode_only_faults_layer_row_shows_the_decode_numbers(tmp_path):
    """The layer row of a decode-only noise showed the prefill's instability (0) beside its
    NOISE_SOURCE verdict: a finding of the decode steps shows their numbers."""
    result = _generate(tmp_path, inject=["noise@layer=2,m=0.05,phase=decode"])
    top = _top(result)
    assert (top["layer"], top["verdict"]) == (2, FAULT) and "NOISE_SOURCE" in top["diagnosis"]
    assert top["instability"] > 0, top
    healthy = result.layers[result.layers["verdict"] == "NORMAL"]
    assert (healthy["instability"].fillna(0) < top["instability"]).all()


@pytest.mark.parametrize("spec, family", [
    ("dead_zone@layer={k},quantile=0.3,site=mlp", "DEAD_ZONE"),
    ("noise@layer={k},m=0.05,site=mlp", "NOISE_SOURCE"),
])
def test_a_kernel_shared_by_every_layer_is_named_systemic(tmp_path, spec, family):
    result = _generate(tmp_path, inject=[spec.format(k=k) for k in range(LAYERS)])
    top = _top(result)
    assert top["verdict"] == FAULT
    assert top["diagnosis"].split(",")[0] == f"SYSTEMIC_{family}", result.layers.head()
    assert f"every mlp ({LAYERS}/{LAYERS} layers)" in result.headlines[0]
    assert "SAT" not in " ".join(result.layers["diagnosis"])  # never relabelled as saturation


# -- the rules on signals, without a model -------------------------------------------------------


def _sig(layer, module, site=0, **values) -> Signals:
    base = dict(samples=2, zero_frac=0.0, flat_zero=0.0, flat_value=0.0, ties=1.0,
                tie_excess=1.0, instability=0.0, instab_changed=0.0, offset=0.01, gain=1.0,
                kurtosis=0.5, batch_dep=0.0, dtype="float32")
    base.update(values)
    return Signals(layer=layer, site=site, module=module, **base)


def _block(layer, **values) -> Signals:
    return _sig(layer, f"model.layers.{layer}", site=-1, **values)


def test_inherited_zeros_are_propagation_not_another_fault():
    """Block 2 makes exact zeros its own replay keeps (flat_zero); blocks 3-5 show zeros their
    replay moves (they came in with the input): one FAULT, the rest DEAD_ZONE_PROP."""
    signals = [_block(k) for k in range(6)]
    signals[2] = _block(2, zero_frac=0.3, flat_zero=0.29)
    for k in (3, 4, 5):
        signals[k] = _block(k, zero_frac=0.1, flat_zero=0.0)
    verdicts = diagnose(signals, "float32", 6)
    assert [v.verdict for v in verdicts].count(FAULT) == 1 and verdicts[2].verdict == FAULT
    assert all(verdicts[k].diagnosis == "DEAD_ZONE_PROP" and verdicts[k].verdict != FAULT
               for k in (3, 4, 5))


def test_an_overflow_born_in_one_layer_is_one_fault_not_a_systemic_kernel():
    """fp16 overflow at layer 5 (Inf in its output) carried by the residual stream: every later
    block and sub-layer holds NaN/Inf too, inherited from its input (issue 28)."""
    signals = []
    for k in range(18):
        bad = dict(inf_count=3 if k == 5 else 0, nan_count=400 if k > 5 else 0)
        signals += [_block(k, **bad), _sig(k, f"model.layers.{k}.mlp", **bad)]
    verdicts = diagnose(signals, "float16", 18)
    assert [v.layer for v in verdicts if v.verdict == FAULT] == [5]
    assert verdicts[5].diagnosis == "OVERFLOW"
    assert not any("SYSTEMIC" in v.diagnosis for v in verdicts)
    assert all(verdicts[k].diagnosis == "OVERFLOW_PROP" for k in range(6, 18))
    # the decode steps read NaN keys and values from the cache the prefill wrote: inherited too
    decode = signals + [
        _block(k, phase="decode", nan_count=50 if k > 6 else 0) for k in range(18)]
    verdicts = diagnose(decode, "float16", 18)
    assert [v.layer for v in verdicts if v.verdict == FAULT] == [5]
    # a kernel that overflows in every layer from a finite input is still one shared kernel
    own = [_sig(k, f"model.layers.{k}.mlp", inf_count=2) for k in range(18)]
    own += [_block(k) for k in range(18)]
    assert "SYSTEMIC_OVERFLOW" in diagnose(own, "float16", 18)[0].diagnosis


def test_a_dead_zone_carried_by_later_layers_is_propagation_not_a_shared_kernel():
    """A strong dead zone at block 10 (bf16, issue 28): the exact zeros it makes reach the MLP
    of every later layer, whose own replay keeps them (exact, not inherited by the old rule),
    far weaker than the source's: one FAULT at 10, the later MLPs DEAD_ZONE_PROP; the same
    weak zeros at every layer from the start stay one shared kernel."""
    def run(first: int):
        signals = [_block(k, dtype="bfloat16") for k in range(30)]
        signals[10] = _block(10, dtype="bfloat16", zero_frac=0.5, flat_zero=0.5)
        signals += [_sig(k, f"model.layers.{k}.mlp", dtype="bfloat16",
                         zero_frac=0.02 if k >= first else 0.0,
                         flat_zero=0.02 if k >= first else 0.0) for k in range(30)]
        return diagnose(signals, "bfloat16", 30)

    verdicts = run(first=11)
    assert [v.layer for v in verdicts if v.verdict == FAULT] == [10]
    assert verdicts[10].diagnosis.split(",")[0] == "DEAD_ZONE"
    assert all(verdicts[k].diagnosis == "DEAD_ZONE_PROP" for k in range(11, 30))
    shared = run(first=0)
    assert any(v.diagnosis.startswith("SYSTEMIC_DEAD_ZONE") for v in shared)


def test_zeros_a_layer_makes_itself_stay_a_fault_after_another_source():
    signals = [_block(k) for k in range(6)]
    signals[2] = _block(2, zero_frac=0.3, flat_zero=0.29)
    signals[4] = _block(4, zero_frac=0.2, flat_zero=0.2)  # its own replay keeps them at 0
    verdicts = diagnose(signals, "float32", 6)
    assert verdicts[4].verdict == FAULT and verdicts[4].diagnosis == "DEAD_ZONE"


def test_limits_follow_each_modules_own_dtype():
    """0.3% exact zeros: a FAULT for an fp32 module, normal rounding for a bf16 one (autocast
    runs bf16 sub-layers inside an fp32 model)."""
    fp32 = [_sig(k, f"model.layers.{k}.mlp", zero_frac=0.003 if k == 1 else 0.0)
            for k in range(4)]
    bf16 = [_sig(k, f"model.layers.{k}.mlp", dtype="bfloat16",
                 zero_frac=0.003 if k == 1 else 0.0) for k in range(4)]
    assert diagnose(fp32, "float32", 4)[1].verdict == FAULT
    assert diagnose(bf16, "float32", 4)[1].verdict != FAULT


def test_lost_precision_is_seen_in_bf16_too():
    signals = [_sig(k, f"model.layers.{k}.mlp", dtype="bfloat16",
                    lowbits=0.9 if k == 2 else 1 / 16) for k in range(4)]
    verdicts = diagnose(signals, "bfloat16", 4)
    assert verdicts[2].verdict == FAULT and "PRECISION" in verdicts[2].diagnosis
    assert [v.verdict for v in verdicts].count(FAULT) == 1


def test_ties_need_an_excess_over_their_neighbours():
    """Many tokens at a bf16 channel's extreme are normal in a long prompt when the next values
    hold as many; a clip piles them up."""
    crowded = [_sig(k, f"model.layers.{k}.mlp", dtype="bfloat16", ties=40.0, tie_excess=1.5)
               for k in range(4)]
    assert all(v.verdict != FAULT for v in diagnose(crowded, "bfloat16", 4))
    crowded[1] = _sig(1, "model.layers.1.mlp", dtype="bfloat16", ties=40.0, tie_excess=30.0)
    assert diagnose(crowded, "bfloat16", 4)[1].verdict == FAULT


def test_noise_everywhere_is_systemic_even_when_the_median_is_noisy():
    signals = [_sig(k, f"model.layers.{k}.mlp", instability=0.01, instab_changed=1.0,
                    batch_dep=0.01, batch_dep_level=0.9, batch_dep_moved=0.001)
               for k in range(8)]
    verdicts = diagnose(signals, "float32", 8)
    assert all(v.diagnosis.split(",")[0] == "SYSTEMIC_NOISE_SOURCE" for v in verdicts)
    assert not any("SAT" in v.diagnosis for v in verdicts)
    assert np.isfinite(verdicts[0].score)


def test_autocast_rounding_is_judged_by_the_compute_dtype():
    """fp32 block outputs of a model run under bf16 autocast hold sums of bf16 matmul results:
    a batched replay moves them by bf16 rounding, not a fault; without autocast it would be."""
    signals = [_block(k, batch_dep=1e-3 if k == 2 else 1e-8, batch_dep_level=0.1,
                      batch_dep_moved=0.2) for k in range(6)]
    assert diagnose(signals, "float32", 6)[2].verdict == FAULT
    verdicts = diagnose(signals, "float32", 6, compute_dtype="bfloat16")
    assert all(v.verdict != FAULT for v in verdicts)


@AUTOCAST
def test_autocast_is_recorded_in_the_dump(tmp_path):
    _generate(tmp_path, autocast=True)
    (path,) = find_dump_files(str(tmp_path))
    with DumpReader(path) as r:
        assert r.meta["autocast_dtype"] == "bfloat16"


def test_right_padded_prefill_is_recorded_and_clean(tmp_path):
    model = build("llama", layers=LAYERS)
    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0  # the second prompt is 20 tokens long
    ids[1, 20:] = 0
    with register_hook(model, DumpConfig(dump_path=str(tmp_path), progress=False)), \
            torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    (path,) = find_dump_files(str(tmp_path))
    with DumpReader(path) as r:
        (rec,) = r.records[r.records["kind"] == KIND_MASK]
        keep = r.read(rec).reshape(2, 30)
    assert keep[0].all() and keep[1, :20].all() and not keep[1, 20:].any()
    result = compare_path(str(tmp_path), progress=False)
    assert FAULT not in set(result.layers["verdict"])


def test_a_second_dead_zone_with_clean_input_stays_a_fault():
    """Zeros a module's replay moves are inherited only when its input has zeros: a small flush
    (few zeros, each moved by the dc shift) after a clean block is a source of its own."""
    signals = [_block(k) for k in range(6)]
    signals[1] = _block(1, zero_frac=0.3, flat_zero=0.29)
    signals[4] = _block(4, zero_frac=0.02, flat_zero=0.0)  # block 3 (its input) has no zeros
    verdicts = diagnose(signals, "float32", 6)
    assert verdicts[1].verdict == FAULT and verdicts[4].verdict == FAULT
    assert verdicts[4].diagnosis == "DEAD_ZONE"


def test_one_source_with_inherited_zeros_is_not_systemic():
    signals = [_block(k) for k in range(30)]
    signals[10] = _block(10, zero_frac=0.3, flat_zero=0.29)
    for k in range(11, 30):
        signals[k] = _block(k, zero_frac=0.25, flat_zero=0.0)
    verdicts = diagnose(signals, "float32", 30)
    assert [v.verdict for v in verdicts].count(FAULT) == 1
    assert not any("SYSTEMIC" in v.diagnosis for v in verdicts)


def test_a_static_kv_cache_keeps_capture_on(tmp_path):
    """A static cache holds a buffer longer than the past: its decode steps are captured (and
    probed: test_a_static_cache_with_padding_is_probed_at_decode), capture never turns
    off."""
    model = build("llama", layers=4)
    config = DumpConfig(dump_path=str(tmp_path), progress=False)
    with register_hook(model, config) as session, torch.no_grad():
        model.generate(torch.randint(1, 128, (1, 20)), max_new_tokens=9, do_sample=False,
                       pad_token_id=0, cache_implementation="static")
    assert session.error is None
    with DumpReader(session.path) as r:
        assert [int(x["step"]) for x in r.rounds] == [0, 1, 2, 7]


def _static_run(tmp_path, inject=()):
    from srdd_dump.compare import compare_path

    model = build("llama", layers=3)
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding: the static cache's masks are 4-D
    options = {"attention_mask": mask, "max_new_tokens": 4, "do_sample": False,
               "pad_token_id": 0, "cache_implementation": "static"}
    with torch.no_grad():
        plain = model.generate(ids, **options)
    config = DumpConfig(dump_path=str(tmp_path), progress=False, inject=list(inject))
    with register_hook(model, config) as session, torch.no_grad():
        captured = model.generate(ids, **options)
    assert torch.equal(plain, captured) and session.error is None
    return session, compare_path(str(tmp_path))


def test_a_static_cache_with_padding_is_probed_at_decode(tmp_path):
    """generate(cache_implementation="static") on a left-padded batch (torch.compile's and
    graph-mode NPU serving's cache): the decode replays attend a copy of the static buffer with
    their own entries written after the past, the prefill's the buffer its 4-D mask spans; the
    references read the padding from those 4-D masks. Before: the prefill replay failed on the
    mask's length (capture turned off), then decode probes and references were 0 of N, and
    the padded rows' zeros were a DEAD_ZONE FAULT in every attention."""
    session, result = _static_run(tmp_path)
    coverage = session.coverage.as_dict()
    for name in ("decode block probes", "decode attention probes", "decode attention "
                 "references", "prefill attention references", "decode MLP references"):
        assert coverage[name]["done"] == coverage[name]["expected"] == 3, (name, coverage)
    assert set(result.layers["verdict"]) == {"NORMAL"}, result.layers


def test_a_decode_only_fault_is_found_with_a_static_cache(tmp_path):
    _, result = _static_run(tmp_path / "f", ["rotary_offset@layer=1,phase=decode"])
    top = result.layers.iloc[0]
    assert (top["layer"], top["verdict"]) == (1, "FAULT"), result.layers
    assert top["diagnosis"].startswith("ATTENTION_MISMATCH")


def test_probe_rows_skip_padding(tmp_path):
    """A small probe store in a left-padded batch: every probe row is an attended row, the
    first attended token of each sequence included."""
    model = build("llama", layers=4)
    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :18] = 0
    ids[1, :18] = 0
    config = DumpConfig(dump_path=str(tmp_path), store="sample:640", progress=False)  # 10 rows
    with register_hook(model, config) as session, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    with DumpReader(session.path) as r:
        rows = r.probe_rows(r.rounds[0])
    keep = mask.reshape(-1).numpy() != 0
    assert len(rows) == 10 and keep[rows].all()
    assert {0, 30 + 18} <= set(rows.tolist())


def test_baseline_leaves_padded_rows_out(tmp_path):
    """Two runs that differ only on padded rows (kernels fill them differently): the baseline
    mode compares the attended rows and finds them equal."""
    from srdd_dump.format.writer import DumpWriter, Round, Tensor

    from dumpfactory import baseline_written

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 16)).astype(np.float32)
    keep = np.ones((2, 8, 1), np.float32)
    keep[1, :3] = 0
    for name, pad_value in (("golden", 0.0), ("mine", 123.0)):
        y = x.copy()
        y[1, :3] = pad_value
        w = DumpWriter(str(tmp_path / f"{name}.h5"), {"rank": 0}, ["model.layers.0"])
        w.submit(Round(sample=0, step=0, batch=2, seq=8, positions=np.arange(8),
                       token_ids=np.arange(16).reshape(2, 8),
                       tensors=[Tensor(0, y, "float32"),
                                Tensor(-1, keep, "float32", kind=KIND_MASK)]))
        w.close()
    result = baseline_written(str(tmp_path / "mine.h5"), str(tmp_path / "golden.h5"))
    row = result.table[result.table["layer"] == 0].iloc[0]
    assert row["verdict"] == "PASS" and row["max_absolute_error"] == 0


def test_a_constant_channel_needs_enough_tokens_to_be_stuck():
    """A healthy bf16 channel at an activation's floor repeats one value over the 4 rows of a
    batch's decode step by chance: no stuck fraction from so few tokens (the hunt options' false
    alarm of issue 28); over enough distinct tokens the same channel is stuck."""
    from srdd_dump.analysis.array_stats import channel_signals
    from srdd_dump.vocabulary import stuck_min_tokens

    rng = np.random.default_rng(0)
    need = stuck_min_tokens(1536)
    assert need == 16 and stuck_min_tokens(64) < need < stuck_min_tokens(14336)
    for rows, measured in ((4, False), (need - 1, False), (need, True), (64, True)):
        out = rng.standard_normal((rows, 1536))
        out[:, 7] = -0.2785  # SiLU's floor, in every row
        stuck = channel_signals(out - out.mean(axis=0), out)[2]
        assert np.isnan(stuck) != measured and (not measured or stuck == 1 / 1536)


@pytest.mark.unit
def test_a_probed_decode_step_beside_other_prefills_counts_as_decode_evidence():
    """vLLM adds requests one by one: the probed first request's decode step 1 runs in the
    forward of the others' prefills. Its probes were counted as "prefill" families, so the
    end said "prefill MLP references (0 of 60 calls)" and nothing of the decode steps."""
    from srdd_dump.capture.requests import Segment
    from srdd_dump.capture.rounds import RoundContext
    from srdd_dump.format.writer import Round

    def context(*segments, step=0):
        return RoundContext(round=Round(sample=0, step=step, batch=1, seq=12,
                                        positions=np.arange(12)),
                            positions=None, rows=None, seed=0, segments=list(segments))

    decode = Segment(0, 1, np.array([9]), sample=0, step=1, probed=True)
    prefills = [Segment(1 + 4 * k, 5 + 4 * k, np.arange(4), sample=1 + k, step=0)
                for k in range(2)]
    assert context(decode, *prefills).probed_phase == "decode"
    prefills[0].probed = True  # a probed prefill too: the forward is replayed as one
    assert context(decode, *prefills).probed_phase == "prefill"
    assert context(*prefills).probed_phase == "prefill"
    # and the other way: probed prefills in a round filed under a decode step are prefill
    assert context(decode, *prefills, step=1).probed_phase == "prefill"
    decode.probed = False
    assert context(decode, *prefills, step=1).probed_phase == "prefill"
