"""Layer-local replay probes: exact replays, stored perturbations, seeds, no side effects."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.format import schema as s
from srdd_dump.format.reader import DumpReader

from tiny_models import ARCHS, build

pytestmark = [pytest.mark.integration, pytest.mark.capture]


def _dump(model, tmp_path, ids, **cfg):
    with register_hook(model, DumpConfig(dump_path=str(tmp_path), **cfg)) as session:
        with torch.no_grad():
            model(input_ids=ids)
    return session


def _rows(r, rec):
    """A clean record restricted to the probe rows of its round, as (rows, width)."""
    rnd = r.rounds[r.rounds["round"] == rec["round"]][0]
    return r.read(rec).reshape(-1, rec["width"])[r.probe_rows(rnd)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batched", [True, False])
def test_replay_reproduces_recorded_output_bit_exactly(arch, batched, tmp_path):
    model = build(arch)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    session = _dump(model, tmp_path, ids, granularity="sublayer", store="full",
                    batch_probes=batched)
    with DumpReader(session.path) as r:
        assert r.sites, "attention/MLP sub-layers are found"
        if batched:
            assert r.status["batched_replays"] > 0 and r.status["sequential_replays"] == 0
        else:
            assert r.status["batched_replays"] == 0
        checked = 0
        for site in [s.BLOCK_SITE, *range(len(r.sites))]:
            for layer in range(4):
                found = r.select(layer, s.KIND_CLEAN, site)
                if not len(found):
                    continue
                (clean,) = found
                want = _rows(r, clean)
                repeats = r.select(layer, s.KIND_REPEAT, site)
                assert len(repeats) == DumpConfig().repeats
                for rec in repeats:
                    np.testing.assert_array_equal(r.read(rec)[0], want)
                # the reference of the perturbed replays is the recorded output too
                np.testing.assert_array_equal(r.read(r.select(layer, s.KIND_REPLAY, site)[0])[0],
                                              want)
                checked += 1
        assert checked == 4 + len(r.sites)


def test_perturbations_are_recorded_and_measure_gain(tmp_path):
    model = build("llama")
    ids = torch.randint(0, 128, (1, 12))
    session = _dump(model, tmp_path, ids, sigmas=[0.1, 0.01], draws=3, dc=[1.0, 2.0])
    with DumpReader(session.path) as r:
        gains = r.select(2, s.KIND_GAIN)
        assert sorted(gains["param"].tolist()) == [0.01] * 3 + [0.1] * 3
        assert len(set(gains["seed"].tolist())) == 6  # every draw has its own seed
        ref = r.read(r.select(2, s.KIND_REPLAY)[0])
        x = r.read(r.select(1)[0]).reshape(-1, 64)[r.probe_rows(r.rounds[0])]  # layer 2 input
        for rec in gains:
            # the recorded perturbation size is sigma * std of each token row
            want = rec["param"] * np.sqrt(np.mean(x.var(axis=1)))
            assert rec["pert_rms"] == pytest.approx(want, rel=0.1)
            gain = np.std(r.read(rec) - ref) / rec["pert_rms"]
            assert 0.5 < gain < 3  # a residual block passes a small perturbation on
        dcs = r.select(2, s.KIND_DC)
        assert dcs["param"].tolist() == [1.0, 2.0]
        assert dcs["pert_rms"][1] == pytest.approx(2 * dcs["pert_rms"][0], rel=1e-3)


def test_linearity_is_reported_only_with_a_second_noise_size(tmp_path):
    from srdd_dump.compare.api import file_signals

    model = build("llama")
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    two = _dump(model, tmp_path / "two", ids, sigmas=[0.1, 0.01])
    one = _dump(model, tmp_path / "one", ids)  # the default: one noise size
    assert DumpConfig().sigmas == [0.1]
    blocks = {}
    for name, session in (("two", two), ("one", one)):
        blocks[name] = [g for g in file_signals(session.path)
                        if g.site == s.BLOCK_SITE and g.phase == "prefill"]
        assert blocks[name] and all(np.isfinite(g.gain) and g.gain > 0 for g in blocks[name])
    # gain(0.01) / gain(0.1) of a smooth block is close to 1; one size has no ratio to give
    assert all(0.5 < g.linearity < 2 for g in blocks["two"])
    assert all(np.isnan(g.linearity) and np.isnan(g.gain_small) for g in blocks["one"])
    # the same top-size draws (same seeds) give the same gain either way
    for a, b in zip(blocks["two"], blocks["one"]):
        assert a.gain == pytest.approx(b.gain, rel=1e-3)


def test_store_sample_keeps_whole_seeded_rows(tmp_path):
    model = build("qwen2")
    ids = torch.randint(0, 128, (2, 20))
    a = _dump(model, tmp_path / "a", ids, store="sample:640", seed=5)
    b = _dump(model, tmp_path / "b", ids, store="sample:640", seed=5)
    c = _dump(model, tmp_path / "c", ids, store="sample:640", seed=6)
    rows = []
    for session in (a, b, c):
        with DumpReader(session.path) as r:
            rnd = r.rounds[0]
            rows.append(r.probe_rows(rnd).tolist())
            assert rnd["prow_len"] == 10  # 640 elements = 10 rows of width 64
            assert r.read(r.select(0, s.KIND_GAIN)[0]).shape == (1, 10, 64)
    assert rows[0] == rows[1] and rows[0] != rows[2]
    # the first token of each of the 2 sequences (rows 0 and 20) is always kept
    assert all({0, 20} <= set(r) and len(set(r)) == 10 for r in rows)


def test_seeds_make_the_dump_reproducible(tmp_path):
    model = build("gpt2")
    ids = torch.randint(0, 128, (1, 10))
    dumps = [_dump(model, tmp_path / str(i), ids, seed=seed) for i, seed in enumerate((3, 3, 4))]
    data = []
    for session in dumps:
        with DumpReader(session.path) as r:
            data.append({(int(x["layer"]), int(x["kind"]), int(x["probe"])): r.read(x)
                         for x in r.select(kind=None)})
    assert data[0].keys() == data[1].keys()
    for key in data[0]:
        np.testing.assert_array_equal(data[0][key], data[1][key])
    gain_keys = [k for k in data[0] if k[1] == s.KIND_GAIN]
    assert any(not np.array_equal(data[0][k], data[2][k]) for k in gain_keys)


def test_probes_leave_user_state_alone(tmp_path):
    model = build("llama")
    ids = torch.randint(0, 128, (1, 8))
    torch.manual_seed(123)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    after_plain = torch.rand(3)
    torch.manual_seed(123)
    with register_hook(model, DumpConfig(dump_path=str(tmp_path), granularity="sublayer")):
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        after_probed = torch.rand(3)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(after_probed, after_plain, rtol=0, atol=0)  # RNG untouched


def test_probes_none_captures_only(tmp_path):
    model = build("bert")
    session = _dump(model, tmp_path, torch.randint(0, 128, (1, 6)), probes="none")
    with DumpReader(session.path) as r:
        assert set(r.records["kind"].tolist()) == {s.KIND_CLEAN}
        assert r.rounds[0]["prow_len"] == 0


def test_a_sublayer_taking_residual_is_perturbed_on_its_hidden_states(tmp_path):
    """HF Bloom's attention and MLP take ``(hidden_states, residual)`` for a fused add: they are
    not serving blocks, and a probe that went into the residual only passed through them, so
    their gain read exactly 1 whatever the sub-layer did."""
    import transformers as tf

    from srdd_dump import DumpConfig, register_hook
    from srdd_dump.capture.probes import hidden_input
    from srdd_dump.format import schema
    from srdd_dump.format.reader import DumpReader

    torch.manual_seed(0)
    config = tf.BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4)
    model = tf.BloomForCausalLM(config).eval()
    mlp = model.transformer.h[0].mlp
    h, r = torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    x, rebuild = hidden_input((h, r), {}, mlp)
    assert x is h
    args, _ = rebuild(h + 1)
    assert torch.equal(args[1], r)  # the residual is left as it was

    with register_hook(model, DumpConfig(dump_path=str(tmp_path), samples=1,
                                         store="full")) as session, torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 12)))
    with DumpReader(session.path) as reader:
        site = reader.sites.index("transformer.h.0.mlp")
        (ref,) = reader.select(0, kind=schema.KIND_REPLAY, site=site)
        reference = reader.read(ref).astype(np.float64)
        for rec in reader.select(0, kind=schema.KIND_GAIN, site=site):
            delta = reader.read(rec).astype(np.float64) - reference
            rms = float(np.sqrt((delta ** 2).mean()))
            # a pass-through would give back the perturbation's own size
            assert abs(rms / float(rec["pert_rms"]) - 1) > 0.01


@pytest.mark.parametrize("store", ["sample:32768", "stats"])
def test_probes_replayed_one_by_one_measure_no_batch_dependence(tmp_path, store):
    """--no-batch-probes replays each perturbed input on its own: the reference is then the
    recorded output itself, and the report said batch_dep 0.0 on every row, with no word
    that the check did not run. It is N/A, and the headline says it was left out."""
    from srdd_dump.compare import compare_path

    model = build("llama", layers=3)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    for batched, folder in ((False, "alone"), (True, "batched")):
        with register_hook(model, DumpConfig(dump_path=str(tmp_path / folder), samples=1,
                                             progress=False, store=store,
                                             batch_probes=batched)), torch.no_grad():
            model(ids)
    alone = compare_path(str(tmp_path / "alone"), progress=False)
    assert alone.layers["batch_dep"].isna().all(), alone.layers["batch_dep"]
    assert alone.sites["batch_dep"].isna().all()
    assert "not tested (left out at capture): batch dependence" in alone.headlines[0]
    batched = compare_path(str(tmp_path / "batched"), progress=False)
    assert batched.layers["batch_dep"].notna().all()
    assert "batch dependence" not in batched.headlines[0]
