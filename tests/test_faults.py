"""Fault simulator: each type changes its site and nothing upstream; specs are validated."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.capture.faultspec import ATTENTION_KERNEL, FAULT_TYPES, parse_fault
from srdd_dump.capture.option_names import named_as_flags
from srdd_dump.errors import UserError
from srdd_dump.format import schema as s
from srdd_dump.format.reader import DumpReader

from tiny_models import build

pytestmark = [pytest.mark.integration, pytest.mark.capture]

IDS = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
OPTIONS = {"saturation": ",m=0.5", "bitflip": ",rate=0.05,bits=exponent", "spike": ",m=20",
           "nondeterminism": ",m=50", "precision": ",dtype=float16"}


def _clean(tmp_path, inject=(), probes="none"):
    model = build("llama")
    cfg = DumpConfig(dump_path=str(tmp_path), granularity="sublayer", probes=probes,
                     inject=list(inject))
    with register_hook(model, cfg) as session:
        with torch.no_grad():
            model(input_ids=IDS)
    r = DumpReader(session.path)
    out = {(int(x["layer"]), int(x["site"])): r.read(x) for x in r.select(None, s.KIND_CLEAN, None)}
    out["sites"] = r.sites
    out["meta"] = r.meta
    out["reader"] = r
    return out


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return _clean(tmp_path_factory.mktemp("healthy"))


def _site_index(dump, name):
    return dump["sites"].index(name)


@pytest.mark.parametrize("kind", [k for k in FAULT_TYPES if k not in ATTENTION_KERNEL])
@pytest.mark.parametrize("site", ["block", "mlp", "attn"])
def test_fault_changes_its_site_and_nothing_upstream(kind, site, healthy, tmp_path):
    spec = f"{kind}@layer=2,site={site}" + OPTIONS.get(kind, "")
    faulty = _clean(tmp_path, [spec])
    sub = {"mlp": "model.layers.2.mlp", "attn": "model.layers.2.self_attn"}.get(site)
    where = (2, _site_index(faulty, sub)) if sub else (2, s.BLOCK_SITE)
    assert not np.array_equal(faulty[where], healthy[where]), f"{spec} changed nothing"
    upstream = [(-1, -1), (0, -1), (1, -1)] + [
        (layer, _site_index(faulty, f"model.layers.{layer}.{n}"))
        for layer in (0, 1) for n in ("self_attn", "mlp")
    ]
    if site == "mlp":  # inside block 2 the attention runs before the MLP
        upstream.append((2, _site_index(faulty, "model.layers.2.self_attn")))
    for key in upstream:
        np.testing.assert_array_equal(faulty[key], healthy[key], err_msg=f"{spec} at {key}")
    (described,) = faulty["meta"]["injected_faults"]
    assert described["type"] == kind and described["layer"] == 2
    assert described["module"] == (sub or "model.layers.2")


def test_sparse_fault_touches_only_its_channels(healthy, tmp_path):
    faulty = _clean(tmp_path, ["bias@layer=1,m=1.0,sparsity=0.25,seed=4"])
    changed = np.any(faulty[(1, -1)] != healthy[(1, -1)], axis=(0, 1))
    assert changed.sum() == 16  # 25% of 64 channels, the same on every token


def test_fault_semantics(healthy, tmp_path):
    x = healthy[(3, -1)]
    dz = _clean(tmp_path / "dz", ["dead_zone@layer=3,m=0.3"])[(3, -1)]
    assert (dz == 0).mean() > 0.5 and np.all((dz == 0) | (dz == x))
    sat = _clean(tmp_path / "sat", ["saturation@layer=3,m=0.3"])[(3, -1)]
    assert np.abs(sat).max() == pytest.approx(0.7 * np.abs(x).max(), rel=1e-5)
    stuck = _clean(tmp_path / "st", ["stuck_at@layer=3,value=2.5"])[(3, -1)]
    assert np.all(stuck == 2.5)
    prec = _clean(tmp_path / "pr", ["precision@layer=3,dtype=bfloat16"])[(3, -1)]
    np.testing.assert_array_equal(prec, s.bf16_bits_to_float32(s.float32_to_bf16_bits(x)))


def test_noise_is_fresh_on_every_call_so_repeats_see_it(tmp_path):
    noisy = _clean(tmp_path, ["noise@layer=1,m=0.1"], probes="repeat")
    r = noisy["reader"]
    clean_rows = r.read(r.select(1)[0]).reshape(-1, 64)[r.probe_rows(r.rounds[0])]
    repeats = [r.read(x)[0] for x in r.select(1, s.KIND_REPEAT)]
    assert all(not np.array_equal(rep, clean_rows) for rep in repeats)
    for layer in (0, 2):  # layer 0 is upstream; layer 2 replays its recorded input
        ref = r.read(r.select(layer)[0]).reshape(-1, 64)[r.probe_rows(r.rounds[0])]
        for rec in r.select(layer, s.KIND_REPEAT):
            np.testing.assert_array_equal(r.read(rec)[0], ref)


@pytest.mark.parametrize("text, message", [
    ("nosuch@layer=1", "unknown fault type"),
    ("bias", "layer=K is required"),
    ("bias@layer=x", "layer must be a whole number, got 'x'"),  # was Python's int() message
    ("bias@layer=1,m=abc", "m must be a number, got 'abc'"),
    ("bias@layer=1,sparsity=0", "sparsity must be"),
    ("bias@layer=1,m", "expected key=value"),
    ("double_scale@layer=1,site=mlp", "inside the attention kernel"),
    ("dead_zone@layer=5,mm=0.3", "unknown option 'mm'"),  # a typo is not silently dropped
    ("bias@layer=5,sparsty=0.1", "unknown option 'sparsty'"),
    # the typo named, not "layer=K is required" (a black-box user's lyer=10)
    ("dead_zone@lyer=10", "unknown option 'lyer' \\(did you mean layer\\?\\)"),
    # a word or number a fault reads only in the program's first forward: checked before it
    # runs (a bad mode stopped the program there with a traceback)
    ("nondeterminism@layer=1,mode=foo", "mode must be one of amplified"),
    ("precision@layer=1,dtype=int8", "dtype must be one of bfloat16, float16, float8_e4m3fn"),
    ("bitflip@layer=1,bits=sign", "bits must be one of mantissa, exponent"),
    ("bitflip@layer=1,rate=often", "rate must be a number"),
    ("noise@layer=1,mode=biased", "noise takes no mode"),
    # accepted before, planting another fault than the one written
    ("bias@layer=1,m=0.2,m=0.3", "m is given twice"),
    ("noise@layer=1,m=nan", "m must be a finite number"),
    ("bitflip@layer=1,rate=5", "rate is a probability"),
    ("saturation@layer=1,mode=absolute,limit=inf", "limit must be a finite number"),
])
def test_bad_fault_specs(text, message):
    with pytest.raises(UserError, match=message):
        parse_fault(text)


def test_every_documented_fault_option_is_accepted():
    """The options the fault types read (faults.py, attention_faults.py) all parse."""
    for text in ("saturation@layer=1,mode=absolute,limit=2,phase=decode,rank=0,scope=sample",
                 "nondeterminism@layer=1,mode=amplified", "stuck_at@layer=1,value=3",
                 "bitflip@layer=1,rate=1e-3,bits=exponent", "precision@layer=1,dtype=float16",
                 "int8@layer=1,per=tensor", "bias@layer=1,quantile=0.5,seed=3,sparsity=0.1",
                 "rotary_offset@layer=1,shift=2"):
        parse_fault(text)


def test_dump_config_refuses_values_of_the_wrong_type_by_name():
    """The in-code API checks what the command line's parser checks: a value of the wrong type
    is a one-line UserError naming the field, not a TypeError later or a capture turned off;
    one fault spec or one noise size given alone is taken as a list of one."""
    for kwargs, name in ((dict(samples="two"), "samples"), (dict(samples=2.5), "samples"),
                         (dict(samples=True), "samples"), (dict(seed="x"), "seed"),
                         (dict(dump_path=123), "dump_path"), (dict(steps=3), "steps"),
                         (dict(sigmas=["a"]), "sigmas"), (dict(inject=[3]), "inject"),
                         (dict(progress="no"), "progress")):
        with pytest.raises(UserError, match=f"DumpConfig {name} must be"):
            DumpConfig(**kwargs)
    config = DumpConfig(inject="noise@layer=3", sigmas=0.05, samples=np.int64(2))
    assert config.inject == ["noise@layer=3"] and config.sigmas == [0.05]
    assert DumpConfig.from_json(config.to_json()) == config


def test_errors_name_the_option_as_the_user_gave_it():
    """In code an error names the DumpConfig field (an in-code user has no flags to look up);
    from srdd-dump's command line (its own config, or the config it hands to the command) the
    flag."""
    cases = ((dict(samples=0), "samples", "--samples"), (dict(steps="x"), "steps", "--steps"),
             (dict(tokens="5:2"), "tokens", "--tokens"), (dict(draws=-1), "draws", "--draws"),
             (dict(repeats=-1), "repeats", "--repeats"), (dict(probes="gian"), "probes",
                                                         "--probes"),
             (dict(store="all"), "store", "--store"), (dict(sigmas=[0]), "sigmas", "--sigma"),
             (dict(probe_samples=-1), "probe_samples", "--probe-samples"),
             (dict(inject=["noise@m=1"]), "inject", "--inject"),
             (dict(granularity="layer"), "granularity", "--granularity"))
    for kwargs, field, flag in cases:
        with pytest.raises(UserError) as in_code:
            DumpConfig(**kwargs)
        assert f"DumpConfig {field}" in str(in_code.value) and "--" not in str(in_code.value)
        with pytest.raises(UserError) as by_command:
            DumpConfig(command="python infer.py", **kwargs)
        assert flag in str(by_command.value) and "DumpConfig" not in str(by_command.value)
    with named_as_flags(), pytest.raises(UserError, match="^--samples must be at least 1"):
        DumpConfig(samples=0)


def test_options_that_would_measure_nothing_are_refused():
    """A dc shift of 0 (its dc_dead would read 1 on every layer), sub-layers named at block
    granularity (none captured) and host replays of no probed sample were taken silently."""
    for kwargs, says in ((dict(dc=[0.0]), "dc must be a non-zero number"),
                         (dict(dc=[1.0, -0.0]), "got 0$"),
                         (dict(granularity="block", sublayers="mlp"),
                          "sublayers names modules inside the blocks"),
                         (dict(reference="host", probe_samples=0), "probes none: give 1")):
        with pytest.raises(UserError, match=says):
            DumpConfig(**kwargs)
    DumpConfig(granularity="op", sublayers="mlp")
    DumpConfig(reference="host", probes="none")


def test_register_hook_refuses_a_config_that_is_not_a_dump_config(tmp_path):
    model = build("llama", layers=2)
    for config, says in (({"dump_path": "d"}, r"got dict\): register_hook\(model, "
                          r"DumpConfig\(\*\*options\)\)"),
                         (str(tmp_path), "got str"), (3, "got int")):
        with pytest.raises(UserError, match=says):
            register_hook(model, config)


def test_dump_config_names_a_keyword_it_does_not_take_and_msits_counterpart():
    """msit users write DumpConfig(token_range=..., module_list=...): the error names the
    field that does the job here (a bare "unexpected keyword argument" did not)."""
    with pytest.raises(TypeError, match="msit's token_range is steps .*its fields: .*steps"):
        DumpConfig(dump_path="d", token_range=[0, 1])
    with pytest.raises(TypeError, match="no field 'smaples'; use samples \\(its fields: "):
        DumpConfig(smaples=2)
    # a close miss of a field names it (a black-box user's sample=, dumppath=, layer=)
    for keyword, field in (("sample", "samples"), ("dumppath", "dump_path"), ("layer", "layers")):
        with pytest.raises(TypeError, match=f"no field '{keyword}'; use {field} "):
            DumpConfig(**{keyword: 1})
    with pytest.raises(TypeError, match="no field 'bogus' \\(its fields: "):
        DumpConfig(bogus=1)
    for keyword, says in (("hook_type", "msit's hook_type is not needed"),
                          ("task", 'task="statistics" is store="stats"'),
                          ("level", "msit's level is granularity"),
                          ("sigma", "use sigmas"), ("no_batch_probes", "use batch_probes=False"),
                          ("eager", "srdd-dump's --eager only")):
        with pytest.raises(TypeError, match=says):
            DumpConfig(**{keyword: 1})
    with pytest.raises(UserError, match="written as text here: '0,1,2'"):
        DumpConfig(steps=[0, 1, 2])  # msit's list form
    assert dataclasses.replace(DumpConfig(samples=2), samples=3).samples == 3


def test_fault_site_errors_are_user_errors():
    model = build("llama")
    with pytest.raises(UserError, match="out of range"):
        register_hook(model, DumpConfig(inject=["bias@layer=9"]))
    with pytest.raises(UserError, match="no site"):
        register_hook(model, DumpConfig(inject=["bias@layer=1,site=nowhere"]))


def test_fault_statistics_scope():
    """Two sequences in one batch: each is clipped at its own limit with scope=sample, at the
    limit of the whole tensor with scope=batch (the default)."""
    from srdd_dump.capture.faults import _Fault

    x = torch.stack([torch.linspace(-1, 1, 64).reshape(4, 16),
                     torch.linspace(-10, 10, 64).reshape(4, 16)])
    y = _Fault(parse_fault("saturation@layer=0,m=0.5,scope=sample")).corrupt(x)
    assert y[0].max() == pytest.approx(0.5) and y[1].max() == pytest.approx(5.0)
    y = _Fault(parse_fault("saturation@layer=0,m=0.5")).corrupt(x)
    assert y[0].max() == pytest.approx(1.0) and y[1].max() == pytest.approx(5.0)
    with pytest.raises(UserError, match="scope"):
        _Fault(parse_fault("bias@layer=0,scope=rank")).corrupt(x)


@pytest.mark.parametrize("phase, hit", [("decode", [5, 6]), ("prefill", [0, 1, 2, 3, 4])])
def test_a_phase_fault_in_a_serving_engines_flat_batch_acts_per_request(phase, hit,
                                                                        monkeypatch):
    """vLLM runs every scheduled request's new tokens as one flat batch: a prefill of 5 tokens
    and two requests' decode steps were one 7-row call, a "prefill" call, so phase=decode
    never acted (found nothing, said nothing) and phase=prefill hit the decode tokens too."""
    import numpy as np

    from srdd_dump.capture import faults
    from srdd_dump.capture.requests import BatchLayout

    monkeypatch.setattr(faults, "engine_batch", lambda tables=True: BatchLayout(
        starts=np.array([0, 5, 6, 7]), slots=None, block_table=None))
    fault = faults._Fault(parse_fault(f"bias@layer=0,m=1,phase={phase}"))
    h = torch.randn(8, 16)  # 7 tokens and one row of padding
    out = fault.hook(torch.nn.Identity(), (h,), h)
    changed = (out != h).any(dim=1).nonzero().flatten().tolist()
    assert changed == hit
    # outside a serving engine, the call decides: a 2-D output of 7 rows is a prefill
    monkeypatch.setattr(faults, "engine_batch", lambda tables=True: None)
    out = fault.hook(torch.nn.Identity(), (h,), h)
    assert bool((out != h).any()) == (phase == "prefill")


def test_a_phase_fault_that_does_not_act_returns_the_output_as_it_came():
    """A module returning a NamedTuple, a decode-only fault on a prefill call: the output was
    rebuilt as a plain tuple (attribute access downstream broke)."""
    import collections

    from srdd_dump.capture import faults

    Out = collections.namedtuple("Out", "hidden extra")
    fault = faults._Fault(parse_fault("bias@layer=0,m=1,phase=decode"))
    out = Out(torch.randn(1, 5, 8), 3)
    assert fault.hook(torch.nn.Identity(), (), out) is out
