"""MoE fixtures: tiny MoE models, SmolLM2 upcycled into a Mixtral, infer_moe.py."""

from __future__ import annotations

import json
import os
import shlex

import pytest
import torch

from capture_utils import FIXTURES, py, run_plain
from moe_models import ARCHS, blocks_path, build, experts_modules, upcycle_smollm2

pytestmark = pytest.mark.integration


def record_routing(model) -> dict:
    """{experts module name: [top_k_index, ...]}, filled by forward hooks on every call."""
    seen: dict = {}
    for name, module in experts_modules(model).items():
        module.register_forward_hook(
            lambda mod, args, out, name=name: seen.setdefault(name, []).append(args[1]))
    return seen


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_moe_builds_generates_and_routes(arch):
    model = build(arch, layers=3, experts=4, top_k=2)
    assert not model.training
    assert len(model.get_submodule(blocks_path(arch))) == 3
    experts = experts_modules(model)
    assert list(experts) == [f"model.layers.{i}.mlp.experts" for i in range(3)]
    for module in experts.values():
        e, two_i, h = module.gate_up_proj.shape
        assert (e, h) == (4, 64) and module.down_proj.shape == (e, h, two_i // 2)
        assert module.num_experts == 4
    routing = record_routing(model)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        again = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 12) and torch.equal(out, again)
    for calls in routing.values():
        assert calls[0].shape == (18, 2)  # prefill: [tokens, top_k], tokens flattened
        assert len(torch.cat([c.flatten() for c in calls]).unique()) > 1


def test_infer_moe_left_padding_matches_one_by_one(tmp_path):
    outs = {}
    for padded in ("none", "left"):
        outs[padded] = tmp_path / f"{padded}.json"
        run_plain(shlex.split(py("infer_moe.py", "--model", "deepseek_v3", "--prompts", "3",
                                 "--new-tokens", "3", "--padded", padded, "--out",
                                 str(outs[padded]))))
    tokens = json.loads(outs["none"].read_text())
    assert len(tokens) == 3 and all(len(t) == 3 for t in tokens)
    assert tokens == json.loads(outs["left"].read_text())


@pytest.mark.slow
def test_upcycled_smollm2_matches_dense_and_routes():
    from smollm2 import load

    dense, tokenizer = load("float32")
    moe, _ = upcycle_smollm2(num_experts=4, top_k=2, seed=0)
    assert type(moe).__name__ == "MixtralForCausalLM"
    routing = record_routing(moe)
    with open(os.path.join(FIXTURES, "prompts.txt")) as fh:
        prompts = [line.strip() for line in fh if line.strip()][:3]
    worst = 0.0
    with torch.no_grad():
        for prompt in prompts:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                 tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, return_tensors="pt").input_ids
            worst = max(worst, (moe(ids).logits - dense(ids).logits).abs().max().item())
    # fp32 noise floor: dense SmolLM2 alone moves by ~9e-5 between 1 and 2 threads (logits ~40).
    assert worst < 2e-4, worst
    assert len(routing) == moe.config.num_hidden_layers
    for name, calls in routing.items():
        assert len(torch.cat([c.flatten() for c in calls]).unique()) > 1, name
