"""The sub-layer references (issue 28): each attention and MLP sub-layer's probe rows recomputed
from the module's input by srdd-dump's own attention and MLP (capture/attention_reference.py,
capture/mlp_reference.py), at default options: in float32, in float64 for a float64 model.

* exact: on a float64 model the reference equals the model's own attention to the rounding
  of its float32 parts (left padding, decode steps reading the KV cache, GQA, Qwen2's biases,
  Gemma 3's q/k norms, query scalar, sliding window and per-layer-type rotary tables);
* healthy models in fp32 and bf16 stay far under the FAIL limit;
* the attention-kernel porting bugs (the simulator's softmax_precision, double_scale,
  rotary_offset, mask_shift, gqa_mapping) are the top row, FAULT, at the planted layer, named
  at the attention with ATTENTION_MISMATCH first;
* faults inside the MLP's operators (a flush in up_proj, a clamp in the activation) are the
  top row, FAULT, at the MLP with MLP_MISMATCH first; an fp8 round trip is PRECISION, not
  saturation;
* a layout it does not know is reported in the coverage, never judged.
"""

from __future__ import annotations

import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.analysis.diagnosis import FAULT
from srdd_dump.compare import compare_path

from capture_utils import float16_on_cpu
from tiny_models import build

pytestmark = pytest.mark.capture

PROMPTS = torch.tensor([[5, 17, 33, 2, 91, 40, 7, 66, 12, 3, 54, 8],
                        [0, 0, 0, 21, 9, 77, 14, 30, 101, 6, 45, 19]])
MASK = torch.tensor([[1] * 12, [0, 0, 0] + [1] * 9])


def _needs(name: str):
    """transformers with the config class ``name`` (Gemma 3: 4.50, SmolLM3: 4.53), or skip."""
    import transformers as tf

    if not hasattr(tf, name):
        pytest.skip(f"transformers {tf.__version__} has no {name}")
    return tf


def _gemma3(dtype: torch.dtype, layers: int = 4):
    tf = _needs("Gemma3TextConfig")
    torch.manual_seed(0)
    config = tf.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=6,
        query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=256)
    return tf.Gemma3ForCausalLM(config).to(dtype).eval()


def _smollm3(dtype: torch.dtype, layers: int = 4):
    tf = _needs("SmolLM3Config")
    torch.manual_seed(0)
    config = tf.SmolLM3Config(  # every 4th layer without rotary (use_rope False)
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, max_position_embeddings=256)
    return tf.SmolLM3ForCausalLM(config).to(dtype).eval()


def _model(arch: str, dtype: torch.dtype):
    if arch == "smollm3":
        return _smollm3(dtype)
    return _gemma3(dtype) if arch == "gemma3" else build(arch, dtype=dtype)


def _dump(tmp_path, model, inject=(), new_tokens: int = 4, **options):
    session = register_hook(model, DumpConfig(dump_path=str(tmp_path), samples=1,
                                              inject=list(inject), **options))
    with torch.no_grad():
        model.generate(input_ids=PROMPTS, attention_mask=MASK, max_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
    session.close()
    return session, compare_path(str(tmp_path))


def _attention_rows(result, name: str = "self_attn"):
    sites = result.sites
    return sites[sites["module"].str.endswith(name)]


@pytest.mark.integration
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "smollm3"])
def test_the_reference_is_the_model_attention_in_float64(tmp_path, arch):
    session, result = _dump(tmp_path, _model(arch, torch.float64))
    rows = _attention_rows(result)
    families = {k: v for k, v in session.coverage.as_dict().items() if "references" in k}
    assert {"prefill attention references", "decode attention references"} <= set(families)
    assert all(f["done"] == f["expected"] > 0 for f in families.values()), families
    assert rows["host_red"].notna().sum() == 2 * 4  # every layer, prefill and decode
    # the model's own code computes its rotary table (and Gemma its norms) in float32, the
    # rest in float64; a wrong reference is off by 1e-3 or more
    assert rows["host_red"].max() < 1e-6, rows[["module", "phase", "host_red"]]
    mlp = _attention_rows(result, "mlp")
    assert mlp["host_red"].notna().sum() == 2 * 4
    assert mlp["host_red"].max() < 1e-12, mlp[["module", "phase", "host_red"]]


@pytest.mark.integration
@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen2", torch.bfloat16),
                                        ("gemma3", torch.float32)])
def test_healthy_attention_stays_far_under_the_limit(tmp_path, arch, dtype):
    _, result = _dump(tmp_path, _model(arch, dtype))
    assert FAULT not in set(result.layers["verdict"])
    limit = 1e-3 if dtype == torch.float32 else 1.5e-1  # the baseline FAIL limits
    assert _attention_rows(result)["host_red"].max() < limit / 10


@pytest.mark.integration
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_references_compute_in_float32_but_for_a_float64_model(tmp_path, dtype):
    """The attention and MLP references are float32 records (a quarter of float64's host cost;
    their rounding a thousandth of fp32's FAIL limit), float64 ones for a float64 model; the
    norms' host replays stay float64."""
    from srdd_dump.format import schema
    from srdd_dump.format.reader import DumpReader

    _dump(tmp_path, _model("llama", dtype))
    (path,) = tmp_path.glob("*.h5")
    want = "float64" if dtype == torch.float64 else "float32"
    with DumpReader(str(path)) as rd:
        seen = {}
        for r in rd.records[rd.records["kind"] == schema.KIND_HOST]:
            name = rd.sites[int(r["site"])].rsplit(".", 1)[-1]
            seen.setdefault(name, set()).add(rd.dtype_of(r))
    assert seen["self_attn"] == {want} and seen["mlp"] == {want}, seen
    assert seen["input_layernorm"] == {"float64"}, seen


KERNEL_FAULTS = ["softmax_precision", "double_scale", "rotary_offset,phase=decode",
                 "mask_shift", "gqa_mapping"]


@pytest.mark.integration
@pytest.mark.parametrize("fault", KERNEL_FAULTS)
def test_attention_kernel_faults_are_named_at_the_attention(tmp_path, fault):
    name = fault.split(",")[0]
    _, result = _dump(tmp_path, build("llama", layers=4, dtype=torch.float32),
                      inject=[f"{name}@layer=2" + fault[len(name):]])
    top = result.layers.iloc[0]
    assert (top["verdict"], int(top["layer"])) == (FAULT, 2), result.headlines
    assert top["site"] == "model.layers.2.self_attn"
    assert top["diagnosis"].split(",")[0] == "ATTENTION_MISMATCH", top["diagnosis"]
    others = result.layers[result.layers["layer"] != 2]
    assert FAULT not in set(others["verdict"])


@pytest.mark.integration
@pytest.mark.parametrize("dtype", [torch.bfloat16, float16_on_cpu(torch.float16)])
@pytest.mark.parametrize("fault", ["double_scale", "softmax_precision,dtype=float16"])
def test_attention_kernel_faults_run_in_half_precision_models(tmp_path, fault, dtype):
    # the simulated kernel once cast float32's lowest value into a bf16 tensor and stopped the
    # user's program on its first call (seen on a bf16 SmolLM2 on a GPU)
    name = fault.split(",")[0]
    session, result = _dump(tmp_path, build("llama", layers=4, dtype=dtype),
                            inject=[f"{name}@layer=2" + fault[len(name):]])
    assert session.error is None and session.site_errors == 0
    attention = _attention_rows(result)
    assert attention["host_red"].notna().sum() == 2 * 4  # every layer, prefill and decode
    clean = attention[~attention["module"].str.contains(r"layers\.2\.")]
    assert clean["host_red"].max() < 1.5e-1 / 10  # the other layers' kernels are untouched


@pytest.mark.integration
def test_the_simulated_kernel_is_the_model_attention_when_the_fault_is_off(tmp_path):
    # a decode-only fault: the prefill runs the faulty kernel's clean path
    model = build("llama", layers=2, dtype=torch.float32)
    with torch.no_grad():
        clean = model(PROMPTS, attention_mask=MASK).logits
    _, result = _dump(tmp_path, model, inject=["mask_shift@layer=1"])
    prefill = _attention_rows(result)
    prefill = prefill[prefill["phase"] == "prefill"]
    assert prefill["host_red"].max() < 1e-5
    with torch.no_grad():  # the fault hooks are gone with the session
        assert torch.equal(model(PROMPTS, attention_mask=MASK).logits, clean)


@pytest.mark.integration
def test_an_unknown_attention_layout_is_reported_not_judged(tmp_path):
    session, result = _dump(tmp_path, build("gpt2", dtype=torch.float32))
    families = {k: v for k, v in session.coverage.as_dict().items()
                if "attention references" in k}
    assert families and all(f["done"] == 0 for f in families.values())
    assert all("no q/k/v projections" in f["first_error"] for f in families.values())
    assert FAULT not in set(result.layers["verdict"])


@pytest.mark.unit
def test_an_out_proj_attention_is_named_for_what_it_is():
    """OPT's attention has float q/k/v Linear projections and an ``out_proj``: the reason said
    was "projections that are not floating-point torch Linear modules" (false)."""
    import transformers as tf

    from srdd_dump.capture.attention_reference import attention_layout

    config = tf.OPTConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, ffn_dim=64,
                          num_attention_heads=4, max_position_embeddings=64,
                          word_embed_proj_dim=32)
    model = tf.OPTForCausalLM(config)
    why = attention_layout(model.model.decoder.layers[0].self_attn, model)
    assert why == "no o_proj output projection (an out_proj layout is not modelled)"


MLP_FAULTS = [("dead_zone@layer=2,site=mlp.up_proj,quantile=0.1", "MLP_MISMATCH"),
              ("saturation@layer=2,site=mlp.act_fn,quantile=0.99", "MLP_MISMATCH")]


@pytest.mark.integration
@pytest.mark.parametrize("fault,label", MLP_FAULTS)
def test_faults_inside_the_mlp_are_found_at_default_options(tmp_path, fault, label):
    _, result = _dump(tmp_path, build("llama", layers=4, dtype=torch.float32), inject=[fault])
    top = result.layers.iloc[0]
    assert (top["verdict"], int(top["layer"])) == (FAULT, 2), result.headlines
    assert top["site"] == "model.layers.2.mlp"
    assert top["diagnosis"].split(",")[0] == label, top["diagnosis"]


class PortedSiLU(torch.nn.Module):
    """A port's own activation kernel put in place of the model's act_fn (a class srdd-dump
    has no formula for), clamping its output as a faulty fused kernel would (``limit``)."""

    def __init__(self, limit: float | None = None):
        super().__init__()
        self.limit = limit

    def forward(self, x):
        y = torch.nn.functional.silu(x)
        return y if self.limit is None else y.clamp(-self.limit, self.limit)


def _ported(limit_at_2: float | None, layers: int = 4):
    model = build("llama", layers=layers, dtype=torch.float32)
    for i, layer in enumerate(model.model.layers):
        layer.mlp.act_fn = PortedSiLU(limit_at_2 if i == 2 else None)
    return model


@pytest.mark.integration
def test_a_ported_activation_module_is_checked_against_the_configured_activation(tmp_path):
    """A clamp inside an activation module of the user's own class (a trial's ClampAct): the
    reference MLP computes the activation the model's config names, so it is found at default
    options; the healthy ported kernel passes."""
    healthy, result = _dump(tmp_path / "ok", _ported(None))
    assert FAULT not in set(result.layers["verdict"]), result.headlines
    assert not any("MLP references" in line for line in healthy.coverage.shortfalls())
    with torch.no_grad():  # a limit that bites on some elements, not all
        probe = _ported(None)
        acts = {}
        probe.model.layers[2].mlp.act_fn.register_forward_hook(
            lambda m, a, out: acts.setdefault("y", out))
        probe(PROMPTS, attention_mask=MASK)
    limit = float(acts["y"].abs().quantile(0.99))
    _, result = _dump(tmp_path / "bad", _ported(limit))
    top = result.layers.iloc[0]
    assert (top["verdict"], int(top["layer"])) == (FAULT, 2), result.headlines
    assert top["diagnosis"].split(",")[0] == "MLP_MISMATCH", top["diagnosis"]


@pytest.mark.integration
def test_an_mlp_reference_that_cannot_be_built_is_said(tmp_path):
    """An activation of an unknown class in a model whose config names none srdd-dump has a
    formula for: the reference MLP is missing evidence, not silently absent."""
    model = _ported(None)
    model.config.hidden_act = "some_new_act"
    session, _ = _dump(tmp_path, model)
    lines = [line for line in session.coverage.shortfalls() if "MLP references" in line]
    assert lines and "PortedSiLU" in lines[0], session.coverage.shortfalls()


@pytest.mark.integration
def test_an_activation_module_of_an_unknown_class_is_an_operator(tmp_path):
    session, _ = _dump(tmp_path, _ported(None), granularity="op", layers="model.layers.2")
    from srdd_dump.format.reader import DumpReader

    with DumpReader(session.path) as r:
        assert "model.layers.2.mlp.act_fn" in r.sites


@pytest.mark.integration
def test_an_fp8_round_trip_is_precision_not_saturation(tmp_path):
    _, result = _dump(tmp_path, build("llama", layers=4, dtype=torch.float32),
                      inject=["precision@layer=2,site=mlp,dtype=float8_e4m3fn"])
    top = result.layers.iloc[0]
    assert (top["verdict"], int(top["layer"])) == (FAULT, 2), result.headlines
    labels = top["diagnosis"].split(",")
    assert "SAT_SOURCE" not in labels and "PILEUP_SAT" not in labels, labels
    assert "PRECISION" in labels


NORM_FAULTS = [("saturation@layer=2,site=input_layernorm,quantile=0.99", "SAT_SOURCE"),
               ("dead_zone@layer=2,site=post_attention_layernorm,quantile=0.1", "DEAD_ZONE"),
               ("precision@layer=2,site=input_layernorm,dtype=bfloat16", "PRECISION")]


@pytest.mark.integration
@pytest.mark.parametrize("fault,label", NORM_FAULTS)
def test_faults_in_the_blocks_norms_are_named_at_the_norm_at_default_options(
        tmp_path, fault, label):
    """A norm's output is the input the sub-layer references start from: only its own site
    (default granularity, with its float64 host replay) sees a fault in it."""
    _, result = _dump(tmp_path, build("llama", layers=4, dtype=torch.float32), inject=[fault])
    top = result.layers.iloc[0]
    assert (top["verdict"], int(top["layer"])) == (FAULT, 2), result.headlines
    assert top["site"] == "model.layers.2." + fault.split("site=")[1].split(",")[0]
    assert top["diagnosis"].split(",")[0] == label, top["diagnosis"]
    assert (result.layers["verdict"] == FAULT).sum() == 1


@pytest.mark.integration
@pytest.mark.parametrize("per", ["token", "tensor"])
def test_an_int8_round_trip_is_quantized_not_a_dead_zone_or_a_clip(tmp_path, per):
    _, result = _dump(tmp_path, build("llama", layers=4, dtype=torch.float32),
                      inject=[f"int8@layer=2,site=mlp,per={per}"])
    top = result.layers.iloc[0]
    assert (top["verdict"], int(top["layer"])) == (FAULT, 2), result.headlines
    labels = top["diagnosis"].split(",")
    assert labels[0] == "QUANTIZED", labels
    assert "SAT_SOURCE" not in labels


@pytest.mark.integration
def test_healthy_norm_sites_are_default_sites_and_pass(tmp_path):
    session, result = _dump(tmp_path, _model("gemma3", torch.float32))
    norms = result.sites[result.sites["role"] == "norm"]
    # Gemma 3: input, post-attention, pre- and post-feed-forward norms of each of 4 blocks
    assert len(set(norms["module"])) == 16, sorted(set(norms["module"]))
    assert not norms["module"].str.contains("self_attn").any()  # q/k norms: the attention's
    assert (result.layers["verdict"] != FAULT).all(), result.headlines
    # every norm call of a probed round got its float64 reference
    norm_refs = {k: v for k, v in session.coverage.as_dict().items()
                 if k.endswith("operator references")}
    assert norm_refs and all(v["done"] == v["expected"] > 0 for v in norm_refs.values())


@pytest.mark.integration
def test_a_mask_passed_by_position_is_read_and_a_4d_mask_only_when_causal(tmp_path):
    model = build("llama", layers=2, dtype=torch.float32)
    session = register_hook(model, DumpConfig(dump_path=str(tmp_path / "a"), samples=1))
    with torch.no_grad():
        model(PROMPTS, MASK)  # model(input_ids, attention_mask): left padding by position
    session.close()
    result = compare_path(str(tmp_path / "a"))
    assert FAULT not in set(result.layers["verdict"])
    assert _attention_rows(result)["host_red"].max() < 1e-4
    # a causal 4-D mask with key padding (a static cache's prefill passes one) is read ...
    session = register_hook(model, DumpConfig(dump_path=str(tmp_path / "b"), samples=1))
    # (additive: transformers 4.x adds a 4-D mask to the scores, a boolean one as 0 and 1)
    allowed = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril() & MASK.bool()[:, None, None, :]
    mask4 = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        model(PROMPTS, attention_mask=mask4)
    session.close()
    (family,) = [v for k, v in session.coverage.as_dict().items() if "attention references" in k]
    assert family["done"] == family["expected"] == 2, family
    assert FAULT not in set(compare_path(str(tmp_path / "b")).layers["verdict"])
    # ... one of another form (packed sequences: two causal blocks) turns the reference off
    session = register_hook(model, DumpConfig(dump_path=str(tmp_path / "c"), samples=1))
    packed = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    packed[:, :, 6:, :6] = False
    packed = torch.zeros(packed.shape).masked_fill(~packed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        model(PROMPTS, attention_mask=packed)
    session.close()
    (family,) = [v for k, v in session.coverage.as_dict().items() if "attention references" in k]
    assert family["done"] == 0 and "not a 2-D tensor" in family["first_error"]
