"""``--store stats`` (issue 17): the reductions computed on the device equal the compare's own
from the tensors, a stats dump gives the same diagnosis as the default store, its size does not
grow with the tokens, and the baseline mode compares its row sample."""

from __future__ import annotations

import glob
import math
import os

import h5py
import numpy as np
import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.analysis.signals import Probe, RoundStats, round_stats
from srdd_dump.capture.config import STATS_ROWS, parse_store
from srdd_dump.capture.reductions import ProbeRows, reduce_round
from srdd_dump.compare import compare_baseline, compare_path
from srdd_dump.compare.api import file_signals
from srdd_dump.compare.stats_rows import StatsLayout
from srdd_dump.errors import UserError
from srdd_dump.format import schema as s
from srdd_dump.format.reader import DumpError, DumpReader

from capture_utils import py, run_cli
from tiny_models import build

pytestmark = pytest.mark.capture

SIGMAS, DRAWS, DC, REPEATS = (0.1, 0.01), 2, (1.0,), 2
DEFAULT = DumpConfig()  # the capture defaults a plain dump is made with
COLUMNS = s.stat_columns(SIGMAS, DRAWS, DC, REPEATS)


def _device_stats(x, dtype, before=None, rows=None, probes=(), valid=None, positions=None,
                  sample=0, ids=None) -> RoundStats | None:
    """reduce_round on torch tensors, through the file's columns, back as RoundStats."""
    t = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    values = reduce_round(
        t(x), dtype, t(before), t(rows),
        [ProbeRows(p.kind, p.param, i, p.pert_rms, t(p.data), p.subset)
         for i, p in _numbered(probes)],
        t(valid), t(positions), t(ids))
    if values is None:
        return None
    row = np.full(len(COLUMNS), np.nan)
    for name, value in values.items():
        row[COLUMNS.index(name)] = value
    return StatsLayout(COLUMNS).round_stats(row, sample, dtype)


def _numbered(probes):
    """(probe index, probe): gains numbered across sigmas, the others within their kind."""
    seen: dict[str, int] = {}
    for p in probes:
        key = "gain" if p.kind == "gain" else p.kind
        i = seen.get(key, 0)
        seen[key] = i + 1
        yield (int(p.param) if p.kind == "scale" else i), p


def _close(a, b, rel=1e-6) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if a is None or b is None:
        return a is b
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_close(x, y, rel) for x, y in zip(a, b))
    a, b = float(a), float(b)
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-12


def _assert_same(want: RoundStats, got: RoundStats) -> None:
    for name in ("count", "mean", "m2", "m3", "m4", "absmax", "zeros", "nan_count",
                 "inf_count"):
        assert _close(getattr(want.moments, name), getattr(got.moments, name), 1e-9), name
    for name in ("pileup", "ties", "tie_excess", "update_rms", "offset", "dc_energy",
                 "consistency", "stuck", "lowbits", "grid", "batch_dep", "dc", "repeats",
                 "scale", "causal", "host"):
        assert _close(getattr(want, name), getattr(got, name)), (
            name, getattr(want, name), getattr(got, name))
    assert _close(sorted(want.gains), sorted(got.gains))
    assert (want.diffs is None) == (got.diffs is None)
    if want.diffs is not None:
        assert got.diffs.kurtosis == pytest.approx(want.diffs.kurtosis, rel=1e-6)


def _probes(x_rows, rows, rng, dtype=np.float32, clipped=False):
    """Every probe kind on the rows ``rows`` of ``x_rows``, with faults in some; ``clipped``:
    channel 5 unmoved by every probe (a clip holds it)."""
    clean = x_rows[rows]
    replay = clean.copy()
    replay[0, :3] += np.float32(1e-3)  # batch dependence
    out = [Probe("replay", 0.0, 0.0, replay)]
    for sigma in SIGMAS:
        for _ in range(DRAWS):
            gain = (replay + sigma * rng.standard_normal(clean.shape)).astype(dtype)
            if clipped:
                gain[:, 5] = replay[:, 5]
            out.append(Probe("gain", sigma, 0.5, gain))
    dc = replay + np.float32(0.7)
    dc[:, 5] = replay[:, 5]  # a channel the constant shift does not move
    out.append(Probe("dc", 1.0, 0.0, dc.astype(dtype)))
    out.append(Probe("repeat", 0.0, 0.0, clean.copy()))
    noisy = clean.copy()
    noisy[1::3, 7] += np.float32(1e-4)
    out.append(Probe("repeat", 0.0, 0.0, noisy))
    scaled = np.clip(clean, -0.9, 0.9).astype(dtype)  # a clamp breaks y(2^k x) = 2^k y(x)
    out += [Probe("scale", 0.0, 0.0, clean.copy()), Probe("scale", 1.0, 0.0, scaled),
            Probe("scale", 3.0, 0.0, scaled)]
    leaked = replay.copy()
    leaked[:4] += np.float32(0.01)
    out.append(Probe("causal", 20.0, 0.0, leaked))
    out.append(Probe("host", 0.0, 0.0, (clean.astype(np.float64)
                                        * (1 + 1e-6 * rng.standard_normal(clean.shape)))))
    return out


@pytest.mark.unit
@pytest.mark.parametrize("case", ["plain", "faulty", "bf16", "padded", "tiny", "int8",
                                  "clamp"])
def test_device_reductions_equal_the_compares(case):
    rng = np.random.default_rng(len(case))
    batch, ntok, width = (1, 3, 16) if case == "tiny" else (2, 48, 64)
    x = rng.standard_normal((batch, ntok, width)).astype(np.float32)
    before = (x - 0.1 * rng.standard_normal(x.shape)).astype(np.float32)
    dtype = "float32"
    if case == "faulty":
        x[..., 3] = np.minimum(x[..., 3], 0.4)  # a clamp: ties at the channel's max
        x[np.abs(x) < 0.05] = 0  # a flush
        x[0, 2, 9], x[1, 5, 1] = np.nan, np.inf
        x[:, :, 11] = 0.25  # a stuck channel
    if case == "clamp":  # one channel of 64 clipped: other channels' values pass the limit
        x[..., 5] = np.clip(x[..., 5], -0.5, 0.5)
        x[1, :3] = x[0, :3]  # repeated rows
    if case == "bf16":
        x = s.bf16_bits_to_float32(s.float32_to_bf16_bits(x))
        dtype = "bfloat16"
    if case == "int8":  # each token row quantised to 8 bits and back
        step = np.abs(x).max(axis=-1, keepdims=True) / 127
        x = (np.rint(x / step) * step).astype(np.float32)
    valid = None
    if case == "padded":
        valid = np.ones(batch * ntok, dtype=bool)
        valid[:7] = False
    positions = np.tile(np.arange(ntok), batch)
    rows = np.sort(rng.choice(batch * ntok, size=min(24, batch * ntok), replace=False))
    probes = _probes(x.reshape(-1, width), rows, rng, clipped=case == "clamp")
    want = round_stats(x, dtype, 3, before, rows, probes, valid, positions)
    got = _device_stats(x, dtype, before, rows, probes, valid, positions, sample=3)
    assert want is not None and got is not None
    _assert_same(want, got)
    if case in ("tiny", "faulty", "bf16"):  # rows under 64 non-zero values (bf16: 128): untested
        assert math.isnan(want.grid)
    else:
        assert want.grid == (1.0 if case == "int8" else 0.0)
    assert want.scale is not None and want.scale[2] == "clip"  # the case exercises each part
    assert want.causal and want.host is not None and want.batch_dep is not None
    assert len(want.dc) == 1 and len(want.repeats) == 2 and want.diffs is not None
    if case == "clamp":  # the clipped values, each at its channel's tied extreme
        clipped = np.abs(x.reshape(-1, width)[rows, 5]) == np.float32(0.5)
        assert want.dc[0][2] == pytest.approx(np.count_nonzero(clipped) / (len(rows) * width))


@pytest.mark.unit
@pytest.mark.parametrize("batch", [1, 2])
def test_repeats_of_one_token_at_an_extreme_are_no_pile_up(batch):
    """A prompt repeating a sentence: early in a model the 12 repeats of one token are alike
    in one channel and round to the same bf16 value at its extreme, though their context makes
    them differ elsewhere. With the token ids known the tie counts different tokens: one token's
    repeats are no pile-up, a clip over many tokens still is (both sides alike; a batch that
    repeats the prompt, whose rows are counted once, keeps the ids with the rows)."""
    rng = np.random.default_rng(7)
    ntok, width = 60, 64
    ids = rng.integers(100, 5000, size=ntok)
    repeats = np.arange(4, ntok, 5)[:12]
    ids[repeats] = 28
    x = rng.standard_normal((1, ntok, width)).astype(np.float32)
    x[0, :, 5] = np.clip(x[0, :, 5], -2.5, None)
    x[0, repeats, 5] = -3.0  # the token's own value in that channel, its repeats rounded alike
    x = s.bf16_bits_to_float32(s.float32_to_bf16_bits(x))
    x, ids = np.repeat(x, batch, axis=0), np.tile(ids, batch)
    unknown = round_stats(x, "bfloat16", 0)
    known = round_stats(x, "bfloat16", 0, ids=ids)
    assert unknown.ties == 12 and unknown.tie_excess >= 12  # read as a pile-up without ids
    assert known.ties == 12 and known.tie_excess <= 3.0  # as a healthy channel's (2-3)
    assert _close(_device_stats(x, "bfloat16", ids=ids).tie_excess, known.tie_excess)
    assert _close(_device_stats(x, "bfloat16").tie_excess, unknown.tie_excess)
    clipped = x.copy()
    clipped[..., 9] = np.minimum(clipped[..., 9], np.float32(0.25))  # a clamp over many tokens
    known = round_stats(clipped, "bfloat16", 0, ids=ids)
    assert known.tie_excess >= 8
    assert _close(_device_stats(clipped, "bfloat16", ids=ids).tie_excess, known.tie_excess)


# a channel of a healthy Gemma 3 270M, bf16 (layer 5's post_attention_layernorm, a left-padded
# batch of 4 prompts, the prefill's 21 distinct rows): its values crowd the levels at its top
GEMMA_TOP = [0.0, 0.30273438, 0.32226562, 0.32226562, 0.32617188, 0.32617188, 0.33398438,
             0.33984375, 0.33984375, 0.34179688, 0.34765625, 0.34765625, 0.34960938,
             0.34960938, 0.3515625] + [0.35351562] * 6


@pytest.mark.unit
def test_ties_that_a_crowded_top_makes_by_chance_are_no_pile_up():
    """6 of 21 tokens on a bf16 channel's top value, 5 more on the 3 levels below it: among
    640 channels chance does this (a false SUSPECT "saturation" on a healthy model). A clamp
    putting as many tokens on one value, the values below it spread as a tail's are, still
    is a pile-up, in the compare and in the stats store alike."""
    rng = np.random.default_rng(3)
    width = 640
    x = rng.standard_normal((1, len(GEMMA_TOP), width)).astype(np.float32)
    x[0, :, 23] = rng.permutation(np.array(GEMMA_TOP, np.float32))
    x = s.bf16_bits_to_float32(s.float32_to_bf16_bits(x))
    healthy = round_stats(x, "bfloat16", 0)
    assert healthy.ties == 6 and healthy.tie_excess <= 3.0  # was 4.0: 0.5 of the FAULT limit
    assert _close(_device_stats(x, "bfloat16").tie_excess, healthy.tie_excess)
    clamped = x.copy()
    col = np.sort(x[0, :, 40])
    clamped[0, :, 40] = np.minimum(x[0, :, 40], col[-6])  # 6 tokens at the limit
    piled = round_stats(clamped, "bfloat16", 0)
    assert piled.tie_excess >= 6
    assert _close(_device_stats(clamped, "bfloat16").tie_excess, piled.tie_excess)


@pytest.mark.unit
def test_repeats_of_a_token_in_many_channels_do_not_crowd_a_clip_out():
    """Ten channels whose extreme 12 repeats of one token share, and one channel clipped on 9
    different tokens: the candidates are ranked by token, so the clip is still judged."""
    rng = np.random.default_rng(11)
    ntok, width = 60, 64
    ids = rng.permutation(np.arange(1000, 1000 + ntok))
    repeats = np.arange(2, 60, 5)[:12]
    ids[repeats] = 7  # one token 12 times
    x = rng.standard_normal((1, ntok, width)).astype(np.float32)
    x[0, :, :10] = np.clip(x[0, :, :10], -2.5, 2.5)
    x[0, repeats, :10] = 3.0  # the repeats tie at the extreme of 10 channels
    x[0, repeats, 40] = 0.0  # (not at the clipped channel's limit)
    top = np.sort(x[0, :, 40])[-9]
    x[0, :, 40] = np.minimum(x[0, :, 40], top)  # a clip: 9 different tokens at the limit
    want = round_stats(x, "float32", 0, ids=ids)
    assert want.tie_excess >= 8, want.tie_excess
    assert _close(_device_stats(x, "float32", ids=ids).tie_excess, want.tie_excess)


@pytest.mark.unit
def test_the_compare_reads_each_rows_token_id(tmp_path):
    """The compare of a dump reads the rounds' input ids: a channel whose extreme 12 repeats of
    one token share is a pile-up only when the dump says they are 12 different tokens."""
    from dumpfactory import write_dump

    rng = np.random.default_rng(3)
    ntok, width = 60, 64
    repeats = np.arange(4, ntok, 5)[:12]
    rounds, same = [], []
    for _ in range(2):
        x = rng.standard_normal((1, ntok, width)).astype(np.float32)
        x[0, :, 5] = np.clip(x[0, :, 5], -2.5, None)
        x[0, repeats, 5] = -3.0
        rounds.append({0: rng.standard_normal((1, ntok, width)).astype(np.float32), 1: x})
        ids = rng.integers(100, 5000, size=(1, ntok))
        ids[0, repeats] = 28
        same.append(ids)
    excess = {}
    for name, ids in (("repeats", same), ("different", None)):
        path = write_dump(str(tmp_path / f"{name}.h5"), rounds, dtype="bfloat16", token_ids=ids)
        excess[name] = next(g.tie_excess for g in file_signals(path) if g.layer == 1)
    assert excess["different"] >= 12 and excess["repeats"] <= 3.0, excess


@pytest.mark.unit
def test_clip_limit_places_equal_on_the_device():
    """reductions._at_clip_limit is array_stats.at_clip_limit: clipped, stuck, few-level and
    non-finite channels, repeated rows (with NaN in them too), few rows."""
    from srdd_dump.analysis.array_stats import at_clip_limit
    from srdd_dump.capture.reductions import _at_clip_limit

    rng = np.random.default_rng(5)
    for n in range(2, 40):
        rows = rng.standard_normal((n % 13 + 2, 32)).astype(np.float32)
        rows[:, :4] = np.clip(rows[:, :4], -0.6, 0.6)
        rows[:, 5] = 0.25
        rows[:, 6] = 0.5 + rng.integers(-3, 4, len(rows)) * 2.0 ** -8  # a few steps
        rows[:, 10] = 0.5 + rng.integers(-10, 11, len(rows)) * 2.0 ** -8  # about 20 steps
        rows[:2, 10], rows[2:4, 10] = 0.5 + 10 * 2.0 ** -8, 0.5 - 10 * 2.0 ** -8
        if n % 3 == 0:
            rows[0, 7], rows[1, 8], rows[:, 9] = np.nan, np.inf, -np.inf
        if n % 4 == 0:
            rows[-1] = rows[0]
        if n % 5 == 0:
            rows = s.bf16_bits_to_float32(s.float32_to_bf16_bits(rows))
        want = at_clip_limit(rows)
        got = _at_clip_limit(torch.from_numpy(rows)).numpy()
        assert np.array_equal(want, got), n


@pytest.mark.unit
def test_device_reductions_of_a_round_left_empty_by_the_mask():
    x = np.ones((1, 4, 8), np.float32)
    valid = np.zeros(4, dtype=bool)
    assert round_stats(x, "float32", 0, valid=valid) is None
    assert _device_stats(x, "float32", valid=valid) is None


@pytest.mark.unit
def test_store_option():
    assert parse_store("stats") == ("stats", 32768, STATS_ROWS)
    assert parse_store("stats:0").rows == 0
    assert parse_store("sample:100") == ("sample", 100, 0)
    assert parse_store("full").elements is None
    for bad in ("stats:x", "stats:-1", "sample:0", "sample", "everything"):
        with pytest.raises(UserError, match="bad DumpConfig store"):
            parse_store(bad)


# -- whole dumps -------------------------------------------------------------------------------


def _dump(tmp, name, store, inject=(), tokens=40, pad=False, seed=0, prompts=2, keep=None,
          **probes):
    """``keep``: DumpConfig tokens (the positions kept); ``tokens``: the prompts' length."""
    model = build("llama", layers=4)
    path = os.path.join(tmp, name)
    config = DumpConfig(dump_path=path, samples=prompts, store=store, progress=False,
                        inject=list(inject), seed=seed, **probes,
                        **({"tokens": keep} if keep else {}))
    torch.manual_seed(1)
    with register_hook(model, config), torch.no_grad():
        for _ in range(prompts):
            ids = torch.randint(0, 128, (2, tokens))
            mask = torch.ones_like(ids)
            if pad:
                mask[0, : tokens // 5] = 0
            model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                           pad_token_id=0)
    return path


# the former default probes: two noise sizes (the linearity) and 3 repeats
FORMER_PROBES = {"sigmas": [0.1, 0.01], "repeats": 3}


@pytest.mark.integration
@pytest.mark.parametrize("pad,probes", [(False, {}), (True, {}), (False, FORMER_PROBES)])
def test_stats_dump_gives_the_default_stores_diagnosis(tmp_path, pad, probes):
    fault = ["saturation@layer=2,quantile=0.95,site=mlp"]
    full = _dump(str(tmp_path), "full", "sample:32768", fault, pad=pad, **probes)
    stats = _dump(str(tmp_path), "stats", "stats", fault, pad=pad, **probes)
    a, b = compare_path(full), compare_path(stats)
    assert a.layers["verdict"].iloc[0] == "FAULT" and int(a.layers["layer"].iloc[0]) == 2
    cols = ["layer", "verdict", "diagnosis", "site"]
    assert a.layers[cols].values.tolist() == b.layers[cols].values.tolist()
    assert b.layers["score"].values == pytest.approx(a.layers["score"].values, rel=1e-5)
    assert a.sites[["module", "phase", "verdict"]].values.tolist() == \
        b.sites[["module", "phase", "verdict"]].values.tolist()
    signals = {(g.layer, g.site, g.phase): g.as_dict() for g in file_signals(
        glob.glob(os.path.join(full, "*.h5"))[0])}
    linear = []
    for g in file_signals(glob.glob(os.path.join(stats, "*.h5"))[0]):
        want = signals.pop((g.layer, g.site, g.phase))
        for name, value in g.as_dict().items():
            assert _close(want[name], value, 1e-5), (g.module, g.phase, name)
        linear.append(math.isfinite(g.linearity))
    assert not signals
    # the stats store's gain columns name each draw's sigma: two sizes give the linearity
    assert any(linear) == (len(probes.get("sigmas", DEFAULT.sigmas)) > 1)


@pytest.mark.integration
def test_stats_dump_size_does_not_grow_with_the_tokens(tmp_path):
    sizes = {}
    for tokens in (24, 96):
        path = _dump(str(tmp_path), f"t{tokens}", "stats", tokens=tokens, prompts=1)
        with h5py.File(glob.glob(os.path.join(path, "*.h5"))[0]) as f:
            sizes[tokens] = (f[s.STATS_VALUES].shape, {
                name: ds.shape for name, ds in f[s.DATA].items()})
            assert f[s.STATS_VALUES].shape[1] == len(
                s.stat_columns(DEFAULT.sigmas, DEFAULT.draws, DEFAULT.dc, DEFAULT.repeats))
            assert set(f[s.RECORDS][:]["subset"]) == {1}  # only the row sample
            assert set(f[s.RECORDS][:]["site"]) == {s.BLOCK_SITE}
    assert sizes[24] == sizes[96]


@pytest.mark.integration
def test_baseline_mode_on_stats_dumps(tmp_path):
    fault = ["noise@layer=2,m=0.05"]
    golden = _dump(str(tmp_path), "golden", "stats")
    mine = _dump(str(tmp_path), "mine", "stats", fault)
    result = compare_baseline(mine, golden)
    t = result.table
    compared = t[t["verdict"] != "N/A"]
    assert len(compared) and set(compared["my_shape"]) <= {f"[1, {n}, 64]" for n in (1, 2)}
    assert int(compared.loc[compared["verdict"] == "FAIL", "layer"].min()) == 2
    assert (compared.loc[compared["layer"] < 2, "verdict"] == "PASS").all()
    assert any("stats dump" in note for note in result.notes)
    # a stats dump against a full one: the full side's same rows
    full = _dump(str(tmp_path), "full", "full")
    t = compare_baseline(golden, full).table
    compared = t[t["verdict"] != "N/A"]
    assert len(compared) == len(t) and (compared["verdict"] == "PASS").all()
    assert (compared["cosine_similarity"] > 0.999999).all()
    assert compared["cmp_fail_reason"].str.contains("sampled rows").all()
    # against a dump of some token positions (--tokens): the sampled rows it kept, or why
    # none (it read "shape mismatch: golden [1, 2, 64] vs my [1, 4, 64]")
    for tokens, kept in (("2:", True), ("-1:", False)):
        some = _dump(str(tmp_path), f"some{tokens}", "full", keep=tokens)
        t = compare_baseline(some, golden).table
        prefill = t[t["step"] == 0]
        assert not prefill["cmp_fail_reason"].str.contains("shape mismatch").any()
        if kept:
            assert (prefill["verdict"] == "PASS").all(), prefill["cmp_fail_reason"]
            assert prefill["cmp_fail_reason"].str.contains("sampled rows of the stats").all()
        else:  # the last position only: a prompt whose sampled rows are all earlier
            none = prefill["cmp_fail_reason"].str.startswith(
                "no sampled row kept: none of the 2 sampled rows of the golden stats dump")
            assert none.any() and (prefill.loc[none, "verdict"] == "N/A").all()
            assert (prefill.loc[~none, "verdict"] == "PASS").all()
    # its sub-layers have no counterpart in the stats dump: said as such, not "0 rows compared"
    from srdd_dump.report.terminal import baseline_text

    text = baseline_text(compare_baseline(golden, full))
    assert "rows compared" not in text
    assert "sub-layers and operators: none compared (" in text and "unmatched: " in text
    # the stats dump lists those sites: they are not "missing", it keeps no rows of them
    assert "no counterpart in my dump: a stats dump keeps rows of its block outputs only" \
        in text, text


@pytest.mark.unit
def test_sub_layers_none_compared_say_the_rows_own_reason():
    """Sub-layer rows of rounds whose inputs differ were said to 'have no counterpart'."""
    import pandas as pd

    from srdd_dump.report.terminal import _why_none

    differ = "inputs differ, batched differently (batch 2 here, 1 in the golden run)"
    sites = pd.DataFrame({"cmp_fail_reason": [f"{differ}: the input ids ..."] * 3
                          + ["no counterpart: golden site x has none in my dump (...)"]})
    assert _why_none(sites) == (f"3 of 4 rows: {differ}; 1 have no counterpart: see the "
                                "unmatched lines")
    assert _why_none(sites.tail(1)) == "1 rows have no counterpart: see the unmatched lines"


@pytest.mark.integration
def test_stats_dump_without_rows_cannot_be_a_baseline(tmp_path):
    path = _dump(str(tmp_path), "norows", "stats:0", prompts=1)
    assert len(compare_path(path).layers) == 4  # the reference-free mode needs no rows
    done = run_cli("srdd-compare", path, "--baseline", path, "-o",
                   str(tmp_path / "r.csv"))
    assert done.returncode != 0
    assert "stats:0" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.integration
def test_stats_store_from_the_command_line(tmp_path):
    out = str(tmp_path / "dumps")
    script = py("infer_tiny.py", "llama")
    done = run_cli("srdd-dump", "--exec", script, "-o", out, "--store", "stats")
    assert done.returncode == 0, done.stderr
    files = glob.glob(os.path.join(out, "*", "*.h5"))
    with DumpReader(files[0]) as reader:
        assert reader.has_stats and len(reader.stats_index)
    report = str(tmp_path / "r.csv")
    done = run_cli("srdd-compare", out, "-o", report)
    assert done.returncode == 0, done.stderr
    bad = run_cli("srdd-dump", "--exec", script, "-o", out, "--store", "stats:x")
    assert bad.returncode != 0 and "bad --store" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.integration
def test_damaged_stats_table_is_refused(tmp_path):
    path = _dump(str(tmp_path), "d", "stats", prompts=1)
    file = glob.glob(os.path.join(path, "*.h5"))[0]
    with h5py.File(file, "a") as f:
        f[s.STATS_VALUES].attrs[s.ATTR_COLUMNS] = '["n"]'
    with pytest.raises(DumpError, match="column names"):
        DumpReader(file)


@pytest.mark.integration
def test_consistency_mode_on_stats_dumps(tmp_path):
    """Three cards dumped with --store stats: the odd card out is named from the row samples."""
    for card in range(3):
        _dump(str(tmp_path), f"card{card}", "stats", prompts=1,
              inject=["noise@layer=2,m=0.05"] if card == 1 else ())
    result = compare_path(str(tmp_path))
    summary = result.consistency.summary
    odd = summary[summary["odd"]]
    assert len(odd) == 1 and odd["source"].iloc[0].startswith("card1")
    assert int(odd["first_departing_layer"].iloc[0]) == 2


@pytest.mark.unit
def test_a_clip_limit_on_a_round_number_is_no_lower_precision():
    """A float32 MLP output clamped to +-0.5 (a user's vLLM fault; an fp16 saturation clips at
    65504 alike): 0.5 has its low mantissa bits 0, so 70% of the values "had" them and a
    decode step read PRECISION only. Distinct values are counted once; a bf16 round trip's
    values are all on its coarse grid however they are counted."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((1, 8, 576)).astype(np.float32)
    clamped = np.clip(x, np.float32(-0.5), np.float32(0.5))
    stats = round_stats(clamped, "float32", 0)
    assert stats.lowbits < 0.01, stats.lowbits
    assert _close(_device_stats(clamped, "float32").lowbits, stats.lowbits)
    coarse = s.bf16_bits_to_float32(s.float32_to_bf16_bits(x))
    assert round_stats(coarse, "float32", 0).lowbits == 1.0
    assert _device_stats(coarse, "float32").lowbits == 1.0
