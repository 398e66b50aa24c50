"""Operator granularity, the exact identities and the float64 host replay (issue 15).

Unit part: the identity checks on arrays with known answers. Integration part: healthy tiny
models of the four architectures in fp32/bf16/fp16 hold every identity exactly and stay under
the host replay's PASS limit; planted operator faults are named at the operator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.analysis.diagnosis import FAULT
from srdd_dump.analysis.identities import (
    CLIP,
    OFFSET,
    OTHER,
    ZERO,
    causal_check,
    relative_distance,
    scale_check,
)
from srdd_dump.analysis.tolerance import DEFAULT_LIMITS
from srdd_dump.capture.discovery import find_blocks, find_operators
from srdd_dump.capture.host import host_copy, host_replay
from srdd_dump.capture.identities import scale_replays
from srdd_dump.compare import compare_path

from capture_utils import cpu_runs_float16, float16_on_cpu
from tiny_models import ARCHS, build

pytestmark = pytest.mark.capture

RNG = np.random.default_rng(0)


# -- the checks on arrays ----------------------------------------------------------------------


def _linear(x, w, limit=None, mode=None, offset=0.0):
    y = x @ w
    if mode == "flush":
        y = np.where(np.abs(y) < limit, 0, y)
    elif mode == "clamp":
        y = np.clip(y, -limit, limit)
    return (y + offset).astype(np.float32)


@pytest.mark.unit
@pytest.mark.parametrize("mode, pattern", [("flush", ZERO), ("clamp", CLIP), ("offset", OFFSET),
                                           ("round", OTHER)])
def test_scale_identity_names_the_pattern(mode, pattern):
    x = RNG.standard_normal((64, 32)).astype(np.float32)
    w = RNG.standard_normal((32, 48)).astype(np.float32) / 6
    healthy = scale_check(_linear(x, w), _linear(2 * x, w) / 2, 1, "float32")
    assert healthy.broken == 0 and healthy.judged == x.shape[0] * 48
    limit = float(np.quantile(np.abs(x @ w), 0.2 if mode == "flush" else 0.9))
    if mode == "round":  # a quantiser with a fixed step
        def f(v):
            return (np.round((v @ w) / 0.05) * 0.05).astype(np.float32)
    elif mode == "offset":
        def f(v):
            return _linear(v, w, offset=0.3)
    else:
        def f(v):
            return _linear(v, w, limit, mode)
    check = scale_check(f(x), f(2 * x) / 2, 1, "float32")
    assert check.broken > 0.01 * check.judged
    assert check.pattern == pattern


@pytest.mark.unit
def test_scale_identity_leaves_out_non_finite_and_overflowing_values():
    ref = np.array([[1.0, np.nan, 3e38, 2.0]], dtype=np.float32)
    scaled = np.array([[1.0, 5.0, 1e38, 2.5]], dtype=np.float32)
    check = scale_check(ref, scaled, 3, "float32")
    assert (check.broken, check.judged) == (1, 2)


@pytest.mark.unit
def test_causal_check_judges_only_rows_before_the_cut():
    ref = RNG.standard_normal((6, 4)).astype(np.float32)
    out = ref.copy()
    out[4:] += 1  # rows at and after the cut may move
    positions = np.arange(6)
    assert causal_check(ref, out, positions, 4) == (0, 16, 0.0)
    out[1, 2] += 1e-3
    moved, judged, size = causal_check(ref, out, positions, 4)
    assert (moved, judged) == (1, 16) and 0 < size < 1e-3


@pytest.mark.unit
def test_relative_distance():
    h = RNG.standard_normal(100)
    assert relative_distance(h, h) == 0
    assert relative_distance(h * (1 + 1e-3), h) == pytest.approx(1e-3)
    assert relative_distance(np.where(np.arange(100) == 3, np.inf, h), h) == np.inf


# -- capture: sites, the identity replays, the host copy ----------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("arch", ARCHS)
def test_operators_are_found_by_type(arch):
    model = build(arch, layers=2)
    ops = find_operators(model, find_blocks(model))
    roles = {}
    for site in ops:
        roles.setdefault(site.role, []).append(site.name)
    per_block_linear = {"llama": 7, "qwen2": 7, "gpt2": 4, "bert": 6}[arch]
    assert len(roles["linear"]) == 2 * per_block_linear
    assert len(roles["norm"]) == 4 and len(roles["act"]) == 2 and len(roles["core"]) == 2
    assert ("rotary" in roles) == (arch in ("llama", "qwen2"))


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, float16_on_cpu(torch.float16)])
def test_scale_replays_are_exact_on_a_healthy_linear(dtype):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96).to(dtype)
    x = torch.randn(1, 40, 64).to(dtype)
    bias = layer.bias.detach().clone()
    with torch.no_grad():
        (k0, ref), *scaled = scale_replays(layer, x)
    assert k0 == 0
    for k, y in scaled:
        assert k > 0 and torch.equal(y, ref), k
    assert torch.equal(layer.bias, bias)  # the module's own bias is untouched
    assert layer.weight.dtype == dtype


@pytest.mark.unit
def test_host_copy_is_float64_without_hooks_and_leaves_the_module_alone():
    model = build("llama", layers=2)
    block = model.model.layers[0]
    calls = []
    handle = block.mlp.register_forward_hook(lambda *a: calls.append(1))
    weight = block.mlp.up_proj.weight.detach().clone()
    clone = host_copy(block)
    assert clone.mlp.up_proj.weight.dtype == torch.float64
    assert not clone.mlp._forward_hooks
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        out = host_replay(block.mlp, (x,), {})
    assert out.dtype == torch.float64 and not calls  # the copy runs without the hooks
    assert torch.equal(block.mlp.up_proj.weight, weight)
    assert block.mlp.up_proj.weight.dtype == torch.float32 and len(block.mlp._forward_hooks) == 1
    with torch.no_grad():
        assert torch.allclose(out.float(), block.mlp(x), rtol=1e-5, atol=1e-6)
    handle.remove()


# -- healthy runs and planted faults -----------------------------------------------------------


def _run(tmp_path, arch="llama", dtype=torch.float32, inject=(), **cfg):
    model = build(arch, layers=4, dtype=dtype)
    gen = torch.Generator().manual_seed(3)
    config = DumpConfig(dump_path=str(tmp_path), samples=2, granularity="op", reference="host",
                        inject=list(inject), progress=False, **cfg)
    with register_hook(model, config), torch.no_grad():
        for n in (19, 30):
            ids = torch.randint(1, 128, (2, n), generator=gen)
            if arch == "bert":
                model(input_ids=ids)
            else:
                model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    return compare_path(str(tmp_path), progress=False)


@pytest.mark.integration
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", float16_on_cpu("float16")])
def test_healthy_models_hold_every_identity(tmp_path, arch, dtype):
    result = _run(tmp_path, arch, getattr(torch, dtype))
    sites, layers = result.sites, result.layers
    linear = sites[sites["role"] == "linear"]
    assert len(linear) and linear["scale_broken"].notna().all()
    assert (linear["scale_broken"] == 0).all()  # bit for bit, every linear operator
    causal = sites["causal_broken"].dropna()
    if arch == "bert":  # bidirectional: no causality probe
        assert causal.empty
    else:
        assert len(causal) >= 4 and (causal == 0).all()
        assert (layers["causal_broken"].dropna() == 0).all()
    host = np.concatenate([sites["host_red"].dropna(), layers["host_red"].dropna()])
    assert host.size and host.max() <= DEFAULT_LIMITS[dtype].rel_dist_warn
    assert FAULT not in set(layers["verdict"]), layers[["layer", "evidence"]]
    assert FAULT not in set(sites["verdict"])


@pytest.mark.integration
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "bert"])
def test_short_prompts_hold_the_causality_identity(tmp_path, arch):
    """Prompts of 2 to 7 tokens at the default options (batched probes, every layer and
    sub-layer): a 2-token prompt was a FAULT "attention mask bug" in every layer, because the
    causality copy's rows were compared with the in-batch copy only, and a row's last bits
    depend on its place in the batch (a GEMM's tail tiles on this CPU)."""
    model = build(arch, layers=2)
    gen = torch.Generator().manual_seed(4)
    config = DumpConfig(dump_path=str(tmp_path), samples=6, probe_samples=6, progress=False)
    with register_hook(model, config), torch.no_grad():
        for n in range(2, 8):
            ids = torch.randint(1, 128, (1, n), generator=gen)
            model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    result = compare_path(str(tmp_path), progress=False)
    causal = result.sites["causal_broken"].dropna()
    assert len(causal) >= 2 and (causal == 0).all(), result.sites[["module", "causal_broken"]]
    assert FAULT not in set(result.layers["verdict"]), result.headlines


@pytest.mark.integration
@pytest.mark.parametrize("spec, module, family", [
    ("dead_zone@layer=2,site=mlp.up_proj,quantile=0.05", "mlp.up_proj", "DEAD_ZONE"),
    ("saturation@layer=1,site=self_attn.q_proj,quantile=0.99", "self_attn.q_proj",
     "SAT_SOURCE"),
    ("bias@layer=2,site=self_attn.v_proj,quantile=0.3", "self_attn.v_proj", "BIAS"),
    ("precision@layer=1,site=mlp.down_proj,dtype=bfloat16", "mlp.down_proj", "PRECISION"),
    ("noise@layer=3,site=mlp.gate_proj,m=0.001", "mlp.gate_proj", "NOISE_SOURCE"),
    ("causal_leak@layer=2,site=attn,m=0.001", "self_attn", "CAUSALITY"),
    ("bias@layer=1,site=post_attention_layernorm,quantile=0.5", "post_attention_layernorm",
     None),
])
def test_operator_faults_are_named_at_the_operator(tmp_path, spec, module, family):
    result = _run(tmp_path, inject=[spec])
    top = result.layers.iloc[0]
    layer = int(spec.split("layer=")[1].split(",")[0])
    assert int(top["layer"]) == layer and top["verdict"] == FAULT, result.headlines
    assert top["site"].endswith(module), top["site"]
    if family:
        assert family in top["diagnosis"].split(","), top["diagnosis"]
    at = result.sites[result.sites["module"] == top["site"]]
    assert FAULT in set(at["verdict"])  # the drill-down row of the operator says it too
    others = result.layers[result.layers["layer"] != layer]
    assert FAULT not in set(others["verdict"])


@pytest.mark.integration
def test_a_precision_fault_in_the_rotary_table_is_found_by_the_host_replay(tmp_path):
    result = _run(tmp_path, inject=["precision@layer=0,site=model.rotary_emb,dtype=bfloat16"])
    top = result.layers.iloc[0]
    assert top["verdict"] == FAULT and top["site"] == "model.rotary_emb", result.headlines
    assert "HOST_MISMATCH" in top["diagnosis"]


@pytest.mark.integration
def test_left_padded_generation_at_operator_granularity(tmp_path):
    """A padded batch: the rotary table then has one row per sequence and token, and the host
    record of every kept row is narrowed like the clean record."""
    model = build("llama", layers=4)
    ids = torch.randint(1, 128, (2, 21), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    ids[1, :7] = 0
    config = DumpConfig(dump_path=str(tmp_path), samples=1, granularity="op", reference="host",
                        progress=False)
    with register_hook(model, config), torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                       pad_token_id=0)
    result = compare_path(str(tmp_path), progress=False)
    assert FAULT not in set(result.layers["verdict"]), result.headlines
    rotary = result.sites[result.sites["role"] == "rotary"]
    assert len(rotary) and (rotary["host_red"].dropna() <= 1e-4).all()


@pytest.mark.integration
@pytest.mark.parametrize("reference", ["none", "host"])
def test_a_plain_batched_forward_at_operator_granularity_is_readable(tmp_path, reference):
    """A forward of a right-padded batch without position ids: the model-level rotary table
    has batch 1 and is stored with the round's shape (a reader rejects any other)."""
    model = build("llama", layers=2)
    ids = torch.randint(1, 128, (3, 17), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    mask[2, 9:] = 0
    config = DumpConfig(dump_path=str(tmp_path), samples=1, granularity="op",
                        reference=reference, progress=False)
    with register_hook(model, config) as session, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert session.records_dropped == 0
    result = compare_path(str(tmp_path), progress=False)
    assert FAULT not in set(result.layers["verdict"]), result.headlines
    assert "rotary" in set(result.sites["role"])


@pytest.mark.integration
def test_identities_allow_for_a_jittery_device(tmp_path):
    """Every MLP adds a fresh 1-ulp jitter on each call (a kernel with atomic adds): the
    repeats show it, and neither identity calls that a fault."""
    result = _run(tmp_path, inject=[f"nondeterminism@layer={k},site=mlp,m=0.00001"
                                    for k in range(4)])
    layers = result.layers
    assert not any("CAUSALITY" in d or "NOT_LINEAR" in d for d in layers["diagnosis"])


@pytest.mark.integration
def test_tf32_matmuls_are_recorded_and_judged_at_their_precision(tmp_path):
    from srdd_dump.compare.sources import inspect
    from srdd_dump.format.reader import find_dump_files

    model = build("llama", layers=2)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        with register_hook(model, DumpConfig(dump_path=str(tmp_path), samples=1,
                                             progress=False)), torch.no_grad():
            model(input_ids=torch.randint(1, 128, (1, 12)))
    finally:
        torch.set_float32_matmul_precision(before)
    (path,) = find_dump_files(str(tmp_path))
    assert inspect(path, "x").compute_dtype == "float16"


@pytest.mark.unit
def test_autocast_is_read_on_every_torch_of_the_range():
    """torch < 2.4 has no device argument to ``is_autocast_enabled``: its per-device functions
    are read instead (autocast was recorded as off on torch 2.1, and rounding judged as
    float32's)."""
    from srdd_dump.capture.model_facts import autocast_dtype

    model = torch.nn.Linear(2, 2)
    assert autocast_dtype(model) == ""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtype(model) == "bfloat16"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert autocast_dtype(model) == ""


def test_tf32_set_through_the_new_precision_api_is_recorded():
    """torch >= 2.9: once ``fp32_precision`` is set, the legacy getters raise; the setting is
    still read (was recorded as "highest" while TF32 was on)."""
    from srdd_dump.capture.model_facts import float32_matmul

    matmul = torch.backends.cuda.matmul
    try:
        before = matmul.fp32_precision
    except (AttributeError, AssertionError):  # torch 2.1 asserts on an unknown attribute
        pytest.skip("this torch has no fp32_precision API")
    try:
        matmul.fp32_precision = "tf32"
        assert float32_matmul("cuda") == "high"
        matmul.fp32_precision = "ieee"
        assert float32_matmul("cuda") == "highest"
    finally:
        matmul.fp32_precision = before
    onednn = torch.backends.mkldnn.matmul
    before = onednn.fp32_precision
    try:
        onednn.fp32_precision = "bf16"  # CPU matmuls in bf16
        assert float32_matmul("cpu") == "medium"
    finally:
        onednn.fp32_precision = before


@pytest.mark.integration
def test_the_hunt_options_do_not_change_what_the_model_computes(tmp_path):
    """Operator probes, identity replays and host replays run beside the user's forward:
    the generated tokens and the logits are bit-identical with and without them."""
    model = build("qwen2", layers=3)
    ids = torch.randint(1, 128, (2, 15), generator=torch.Generator().manual_seed(7))

    def generate():
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=5, do_sample=True, pad_token_id=0)
            return out, model(input_ids=out).logits

    plain_tokens, plain_logits = generate()
    config = DumpConfig(dump_path=str(tmp_path), granularity="op", reference="host",
                        progress=False)
    with register_hook(model, config):
        tokens, logits = generate()
    assert torch.equal(tokens, plain_tokens) and torch.equal(logits, plain_logits)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())  # every hook removed


@pytest.mark.integration
@pytest.mark.skipif(not cpu_runs_float16(), reason="this torch has no float16 kernels on CPU")
def test_a_few_layers_cannot_carry_a_relative_fault(tmp_path):
    """Healthy tiny Qwen2 in fp16 (4 layers): one MLP's mean offset reaches z = 15 among the 4;
    a median and MAD of 4 values cannot carry a FAULT (found by bench/identities.py)."""
    model = build("qwen2", dtype=torch.float16)
    gen = torch.Generator().manual_seed(90)
    config = DumpConfig(dump_path=str(tmp_path), samples=2, granularity="op", reference="host",
                        progress=False)
    with register_hook(model, config), torch.no_grad():
        for n in (24, 37):
            model.generate(torch.randint(1, 128, (2, n), generator=gen), max_new_tokens=8,
                           do_sample=False, pad_token_id=0)
    result = compare_path(str(tmp_path), progress=False)
    assert FAULT not in set(result.layers["verdict"]), result.headlines


@pytest.mark.unit
def test_zeros_of_the_computation_are_told_from_a_flush():
    """A saturated GELU tail rounds to exact 0 on the device where the float64 value is ~1e-9:
    explained; a flush of the 20% smallest outputs (most of them not in that tail) zeros values
    the host holds far from 0."""
    from srdd_dump.analysis.identities import zeros_explained

    x = RNG.standard_normal((16, 64)) * 3
    host = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    device = host.astype(np.float32)
    device[x < -5.5] = 0.0
    assert (device == 0).any() and zeros_explained(device, host, "float32") == 1.0
    limit = np.quantile(np.abs(host), 0.2)
    flushed = np.where(np.abs(host) < limit, 0.0, host).astype(np.float32)
    flushed[x < -5.5] = 0.0
    assert zeros_explained(flushed, host, "float32") < 0.9
    assert np.isnan(zeros_explained(host + 1.0, host, "float32"))  # no zeros: nothing to say
