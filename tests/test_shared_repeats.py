"""A sub-layer's repeats are taken from its block's repeats when its input there is its
recorded input bit for bit (capture/shared_repeats.py), and run alone otherwise: the repeat
records are what a sub-layer re-run alone gives, in both cases."""

from __future__ import annotations

import glob

import numpy as np
import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.capture.replays import Replays
from srdd_dump.format import schema
from srdd_dump.format.reader import DumpReader

from moe_models import build as build_moe
from moe_models import experts_modules
from tiny_models import build

pytestmark = pytest.mark.capture

REPEATS = 2  # unperturbed re-runs of the dumps here (the default since 2026-11-28)

PROMPT = torch.tensor([[5, 17, 9, 33, 61, 2, 44, 8, 19, 70, 12, 3]])


def _dump(tmp_path, model):
    session = register_hook(model, DumpConfig(dump_path=str(tmp_path), samples=1,
                                              progress=False, repeats=REPEATS))
    with torch.no_grad():
        model.generate(PROMPT, max_new_tokens=3, do_sample=False, pad_token_id=0)
    session.close()
    return DumpReader(glob.glob(str(tmp_path / "*.h5"))[0])


def _sublayer_repeats(reader: DumpReader, name: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(clean rows at the probe rows, repeat) of every repeat record of sub-layer ``name``."""
    site = reader.sites.index(name)
    pairs = []
    for rec in reader.select(kind=schema.KIND_REPEAT, site=site):
        round_row = reader.rounds[int(rec["round"])]
        clean = next(c for c in reader.select(layer=int(rec["layer"]), site=site)
                     if int(c["round"]) == int(rec["round"]))
        rows = reader.read(clean).reshape(-1, reader.read(clean).shape[-1])
        pairs.append((rows[reader.probe_rows(round_row)], reader.read(rec).reshape(
            -1, rows.shape[-1])))
    return pairs


def test_sublayer_repeats_come_from_the_block_and_equal_the_recorded_output(tmp_path):
    model = build("llama", layers=3)
    reader = _dump(tmp_path, model)
    # 3 layers x 2 sub-layers x REPEATS repeats, in each probed round (the prefill, decode step 1)
    assert reader.status["repeats_from_blocks"] == 3 * 2 * REPEATS * 2
    for name in ("model.layers.1.self_attn", "model.layers.2.mlp"):
        pairs = _sublayer_repeats(reader, name)
        assert len(pairs) == REPEATS * 2  # each probed round's repeats
        for clean, again in pairs:
            np.testing.assert_array_equal(again, clean)


def test_a_sublayer_whose_input_differs_in_the_block_run_repeats_alone(tmp_path):
    """An unstable norm before the attention: in the block's repeats the attention sees
    another input, so its repeats are its own re-runs on its recorded input (equal to the
    recorded output), not the block run's outputs."""
    model = build("llama", layers=3)
    norm = model.model.layers[1].input_layernorm
    calls = {"n": 0}

    def unstable(module, args, output):
        calls["n"] += 1
        return output + 1e-3 * calls["n"]  # a different output at every call

    handle = norm.register_forward_hook(unstable)
    try:
        reader = _dump(tmp_path, model)
    finally:
        handle.remove()
    # layer 1's attention and, after it, its MLP (REPEATS repeats x 2 probed rounds each) ran
    # alone; the other layers' sub-layers shared their block's repeats
    assert reader.status["repeats_from_blocks"] == 3 * 2 * REPEATS * 2 - 2 * REPEATS * 2
    for name in ("model.layers.1.self_attn", "model.layers.1.mlp"):
        pairs = _sublayer_repeats(reader, name)
        assert len(pairs) == REPEATS * 2  # each probed round's repeats
        for clean, again in pairs:
            np.testing.assert_array_equal(again, clean)


def _falcon():
    """A block that adds into its MLP's output in place after the MLP returns (HF Falcon with
    parallel attention: ``mlp_output += attention_output``)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, parallel_attn=True,
                             new_decoder_architecture=False, multi_query=False, bias=False)
    return tf.FalconForCausalLM(config).eval()


def _run(tmp_path, model, **options) -> DumpReader:
    session = register_hook(model, DumpConfig(dump_path=str(tmp_path), samples=1,
                                              progress=False, steps="0", **options))
    with torch.no_grad():
        model(PROMPT)
    session.close()
    return DumpReader(glob.glob(str(tmp_path / "*.h5"))[0])


def test_a_sublayer_output_changed_in_place_by_its_block_is_recorded_as_it_was(tmp_path):
    model = _falcon()
    mlp = "transformer.h.1.mlp"
    # unbatched probes: the MLP's replay record is its own recorded output
    reader = _run(tmp_path / "full", model, batch_probes=False)
    site = reader.sites.index(mlp)
    clean = reader.read(reader.select(layer=1, site=site)[0]).reshape(-1, 64)
    replay = reader.read(reader.select(layer=1, kind=schema.KIND_REPLAY, site=site)[0])
    np.testing.assert_array_equal(replay.reshape(-1, 64),
                                  clean[reader.probe_rows(reader.rounds[0])])
    # the statistics store reduces the MLP's output as the MLP returned it
    stats = _run(tmp_path / "stats", model, store="stats")
    row = next(i for i, r in enumerate(stats.stats_index)
               if int(r["layer"]) == 1 and int(r["site"]) == stats.sites.index(mlp))
    values = stats.stats_row(row)
    assert values["absmax"] == pytest.approx(float(np.abs(clean).max()), rel=1e-6)
    assert values["mean"] == pytest.approx(float(clean.astype(np.float64).mean()), abs=1e-7)


def test_a_failed_hand_over_is_one_site_error_and_the_capture_goes_on(tmp_path, monkeypatch):
    from srdd_dump.capture import sinks

    model = build("llama", layers=3)
    with register_hook(model, DumpConfig(dump_path=str(tmp_path / "none"))) as session:
        sublayers = {session.site_names.index(f"model.layers.1.{name}")
                     for name in ("self_attn", "mlp")}
    real = sinks.TensorSink.probe

    def failing(self, ctx, layer, site, rows, kind, *args, **kwargs):
        if site in sublayers and kind == schema.KIND_REPEAT:
            raise RuntimeError("a sink that fails")
        return real(self, ctx, layer, site, rows, kind, *args, **kwargs)

    monkeypatch.setattr(sinks.TensorSink, "probe", failing)
    reader = _dump(tmp_path, model)
    assert reader.complete
    # layer 1's attention and MLP at the prefill (a decode step's failure is a skipped replay)
    assert reader.status["site_errors"] == 2
    assert reader.status["decode_replays_skipped"] == 2
    assert len(reader.select(layer=2, kind=schema.KIND_REPEAT, site=None)) > 0
    # and the coverage does not count those probes as done (one failed call per family)
    coverage = reader.status["coverage"]
    for family in ("prefill attention probes", "prefill MLP probes", "decode attention probes",
                   "decode MLP probes"):
        entry = coverage[family]
        assert entry["done"] == entry["expected"] - 1, (family, entry)
        assert "a sink that fails" in entry["first_error"]


def _fused_moe(arch: str):
    """A tiny MoE model with fused experts modules (transformers 5; older releases hold one
    module per expert, captured as plain sub-modules: nothing to share)."""
    try:
        model = build_moe(arch, layers=3)
    except AttributeError:  # an architecture this transformers does not have
        pytest.skip(f"no {arch} in this transformers")
    if not experts_modules(model):
        pytest.skip("no fused experts module in this transformers")
    return model


def _moe_dump(tmp_path, model, **options) -> DumpReader:
    session = register_hook(model, DumpConfig(dump_path=str(tmp_path), samples=1,
                                              progress=False, **{"repeats": REPEATS,
                                                                 **options}))
    with torch.no_grad():
        model.generate(PROMPT, max_new_tokens=3, do_sample=False, pad_token_id=0)
    session.close()
    return DumpReader(glob.glob(str(tmp_path / "*.h5"))[0])


def _records(reader: DumpReader) -> dict:
    """Every record by (round, layer, site, kind, probe)."""
    return {(int(r["round"]), int(r["layer"]), int(r["site"]), int(r["kind"]),
             int(r["probe"])): reader.read(r) for r in reader.select(kind=None, site=None)}


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_expert_slot_repeats_come_from_the_block_and_equal_the_slots_re_run(
        tmp_path, monkeypatch, arch):
    """A fused experts call's slots are repeated by the block's repeats: where the block's
    experts call reproduced the recorded output from the recorded input, the slots' repeat
    is the clean slots, and every record equals a dump whose slots re-ran alone."""
    model = _fused_moe(arch)
    shared = _moe_dump(tmp_path / "shared", model)
    # 3 layers x (attention, MLP, slots) x REPEATS repeats, in each probed round (2)
    assert shared.status["repeats_from_blocks"] == 3 * 3 * REPEATS * 2
    slots = shared.sites.index("model.layers.1.mlp.experts.slots")
    pairs = _sublayer_repeats(shared, "model.layers.1.mlp.experts.slots")
    assert len(pairs) == REPEATS * 2  # each probed round's repeats
    for clean, again in pairs:
        np.testing.assert_array_equal(again, clean)
    real = Replays._shares_repeats

    def sublayers_only(self, module, layer, site, spec):
        return self.sites[site].role != "experts" and real(self, module, layer, site, spec)

    monkeypatch.setattr(Replays, "_shares_repeats", sublayers_only)
    alone = _moe_dump(tmp_path / "alone", model)
    assert alone.status["repeats_from_blocks"] == 3 * 2 * REPEATS * 2
    got, want = _records(shared), _records(alone)
    assert got.keys() == want.keys()
    assert sum(key[2] == slots and key[3] == schema.KIND_REPEAT for key in got) == REPEATS * 2
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=str(key))


def test_expert_slots_whose_experts_call_changes_repeat_alone(tmp_path):
    """An experts module whose output differs at every call: the block's repeat does not
    reproduce its recorded output, so its slots re-run alone (their repeats differ from the
    clean slots: the instability is measured, not taken from the block)."""
    model = _fused_moe("mixtral")
    experts = model.model.layers[1].mlp.experts
    calls = {"n": 0}

    def unstable(module, args, output):
        calls["n"] += 1
        return output + 1e-3 * calls["n"]

    handle = experts.register_forward_hook(unstable)
    try:
        reader = _moe_dump(tmp_path, model)
    finally:
        handle.remove()
    # layer 1's slots ran their REPEATS repeats alone in both probed rounds; its MLP's input is
    # its recorded input in the block's run, so the MLP's repeats still come from there
    assert reader.status["repeats_from_blocks"] == 3 * 3 * REPEATS * 2 - REPEATS * 2
    pairs = _sublayer_repeats(reader, "model.layers.1.mlp.experts.slots")
    assert len(pairs) == REPEATS * 2  # each probed round's repeats
    for clean, again in pairs:
        assert not np.array_equal(again, clean)
    for clean, again in _sublayer_repeats(reader, "model.layers.2.mlp.experts.slots"):
        np.testing.assert_array_equal(again, clean)


def test_expert_slots_of_the_stats_store_take_the_block_repeats(tmp_path):
    model = _fused_moe("deepseek_v3")
    reader = _moe_dump(tmp_path, model, store="stats")
    assert reader.complete and reader.status["site_errors"] == 0
    assert reader.status["repeats_from_blocks"] == 3 * 3 * REPEATS * 2
