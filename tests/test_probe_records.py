"""Schema 5: a site's probe outputs of a round are one KIND_PROBES record described probe by
probe in /probes; files of schema 4 (one record per probe output) are read as before, with
the same records, data and signals."""

from __future__ import annotations

import dataclasses
import math

import h5py
import numpy as np
import pytest

from srdd_dump.compare.api import file_signals
from srdd_dump.format import schema as s
from srdd_dump.format.reader import DumpError, DumpReader
from srdd_dump.format.writer import DumpWriter, Round, Tensor

pytestmark = pytest.mark.unit

WIDTH = 32
LAYERS = 4
SITES = [f"model.layers.{i}.mlp" for i in range(LAYERS)]
ROWS = np.array([0, 3, 5, 8], dtype=np.int32)  # the round's probe rows (of 2 x 6 token rows)


def _probes(rng, layer: int, site: int, clean: np.ndarray) -> list[Tensor]:
    """Every probe kind of the default scan, as capture hands them to the writer: replay,
    gain draws, dc, repeats, causal, and a float64 host reference (all on the probe rows)."""
    rows = clean.reshape(-1, WIDTH)[ROWS][None]
    out = [Tensor(layer, rows.copy(), "float32", s.KIND_REPLAY, site, subset=True)]
    for i, sigma in enumerate((0.1, 0.1, 0.01, 0.01)):
        noise = rng.standard_normal(rows.shape).astype(np.float32) * sigma
        out.append(Tensor(layer, rows + noise, "float32", s.KIND_GAIN, site, probe=i,
                          param=sigma, seed=1000 + i, pert_rms=float(sigma), subset=True))
    out.append(Tensor(layer, rows + 0.5, "float32", s.KIND_DC, site, param=1.0, subset=True))
    for t in range(3):
        out.append(Tensor(layer, rows.copy(), "float32", s.KIND_REPEAT, site, probe=t,
                          subset=True))
    cut = rows.copy()
    cut[0, 2:] += 1.0
    out.append(Tensor(layer, cut, "float32", s.KIND_CAUSAL, site, param=3.0, seed=7,
                      subset=True))
    out.append(Tensor(layer, rows.astype(np.float64) + 1e-9, "float64", s.KIND_HOST, site,
                      subset=True))
    return out


def _rounds(seed: int = 0) -> list[Round]:
    rng = np.random.default_rng(seed)
    rounds = []
    for sample in range(3):
        tensors = []
        for layer in range(-1, LAYERS):
            x = rng.standard_normal((2, 6, WIDTH)).astype(np.float32)
            tensors.append(Tensor(layer, x, "float32"))
            if layer >= 0:
                tensors += _probes(rng, layer, s.BLOCK_SITE, x)
                mlp = rng.standard_normal((2, 6, WIDTH)).astype(np.float32)
                tensors.append(Tensor(layer, mlp, "float32", site=layer))
                tensors += _probes(rng, layer, layer, mlp)
                # a model-level host record of every kept row (subset 0)
                tensors.append(Tensor(layer, mlp.astype(np.float64), "float64", s.KIND_HOST,
                                      layer, subset=False))
        rounds.append(Round(sample=sample, step=0, batch=2, seq=6, positions=np.arange(6),
                            token_ids=rng.integers(0, 100, (2, 6)), probe_rows=ROWS,
                            tensors=tensors))
    return rounds


def _write(path, version: int, rounds: list[Round] | None = None) -> str:
    w = DumpWriter(str(path), {"hidden_dtype": "float32",
                               "site_roles": ["sublayer"] * LAYERS},
                   [f"model.layers.{i}" for i in range(LAYERS)], SITES, max_pending=0,
                   version=version)
    for r in rounds or _rounds():
        w.submit(r)
    return w.close()


FIELDS = ("round", "layer", "site", "kind", "probe", "param", "seed", "pert_rms", "subset",
          "batch", "ntok", "nrows", "width")


def _view(rd: DumpReader) -> list[tuple]:
    """Every record (its fields but where its rows lie) with its data, sorted."""
    out = []
    for rec in rd.records:
        out.append((tuple(rec[f].item() for f in FIELDS), rd.dtype_of(rec),
                    rd.read(rec).tobytes()))
    return sorted(out)


def test_one_probe_record_per_site_and_round_with_its_probes_described(tmp_path):
    path = _write(tmp_path / "new.h5", s.SCHEMA_VERSION)
    with h5py.File(path) as f:
        assert f.attrs["schema_version"] == s.SCHEMA_VERSION == 5
        stored, probes = f["records"][()], f["probes"][()]
        assert sorted(f["data"]) == ["clean_float32_32", "probes_float32_32",
                                     "probes_float64_32"]
    groups = stored[stored["kind"] == s.KIND_PROBES]
    # per round: each of the 4 blocks and 4 sub-layers has one float32 group (replay, 4 gain,
    # dc, 3 repeat, causal: 10 probes) and one float64 group (the host references)
    assert len(groups) == 3 * 2 * 2 * LAYERS
    assert len(stored) == len(groups) + 3 * (1 + 2 * LAYERS)
    assert len(probes) == 3 * LAYERS * (11 + 12)
    assert not ((stored["kind"] != s.KIND_PROBES) & (stored["kind"] != s.KIND_CLEAN)).any()
    for i in np.flatnonzero(stored["kind"] == s.KIND_PROBES):
        mine = probes[probes["record"] == i]
        n = mine["batch"].astype(np.int64) * mine["ntok"]
        # the probes tile their record's rows in order
        assert mine["row0"].tolist() == (np.cumsum(n) - n).tolist()
        assert int(n.sum()) == int(stored["nrows"][i]) == int(stored["ntok"][i])
        assert stored["batch"][i] == 1 and stored["probe"][i] == len(mine)
    with DumpReader(path) as rd:
        assert rd.version == 5
        assert len(rd.stored_records) == len(stored)
        assert len(rd.records) == len(stored) - len(groups) + len(probes)
        # the per-probe view: each probe row as a record of its own, in its group's place
        assert (rd.group >= 0).sum() == len(probes)
        gains = rd.select(layer=2, kind=s.KIND_GAIN, site=2)
        assert gains["probe"].tolist() == [0, 1, 2, 3] * 3
        assert gains["seed"].tolist() == [1000, 1001, 1002, 1003] * 3
        np.testing.assert_allclose(gains["param"], [0.1, 0.1, 0.01, 0.01] * 3)
        (host_all,) = [r for r in rd.select(1, s.KIND_HOST, 1) if not r["subset"]
                       and r["round"] == 0]
        assert rd.dtype_of(host_all) == "float64" and rd.read(host_all).shape == (2, 6, WIDTH)


def test_round_trip_gives_the_tensors_written(tmp_path):
    rounds = _rounds()
    with DumpReader(_write(tmp_path / "new.h5", s.SCHEMA_VERSION, rounds)) as rd:
        for n, r in enumerate(rounds):
            for t in r.tensors:
                found = [x for x in rd.select(t.layer, t.kind, t.site)
                         if x["round"] == n and x["probe"] == t.probe
                         and x["subset"] == int(t.subset) and rd.dtype_of(x) == t.dtype]
                assert len(found) == 1
                rec = found[0]
                assert (rec["param"], rec["seed"], rec["pert_rms"]) == (t.param, t.seed,
                                                                        t.pert_rms)
                np.testing.assert_array_equal(rd.read(rec), s.decode(t.array, t.dtype))


def test_a_schema_4_file_reads_as_the_same_records_and_signals(tmp_path):
    """The old layout (one record per probe output, kind-named data sets, no /probes) is
    still read: the same records, the same data, the same reference-free signals."""
    old = _write(tmp_path / "old.h5", 4)
    new = _write(tmp_path / "new.h5", s.SCHEMA_VERSION)
    with h5py.File(old) as f:
        assert f.attrs["schema_version"] == 4 and "probes" not in f
        assert "gain_float32_32" in f["data"] and "host_float64_32" in f["data"]
    with DumpReader(old) as a, DumpReader(new) as b:
        assert a.version == 4 and (a.group == -1).all()
        assert len(a.records) == len(a.stored_records) == len(b.records)
        assert _view(a) == _view(b)
    want, got = file_signals(old), file_signals(new)
    assert len(want) == len(got) == 2 * LAYERS
    for w, g in zip(want, got):
        for field in dataclasses.fields(w):
            x, y = getattr(w, field.name), getattr(g, field.name)
            same = (isinstance(x, float) and isinstance(y, float) and math.isnan(x)
                    and math.isnan(y)) or x == y
            assert same, (w.module, field.name, x, y)
    # the probes were read: gains, dc, repeats, host distance all measured
    block = next(g for g in got if g.layer == 1 and g.site == s.BLOCK_SITE)
    assert math.isfinite(block.gain) and math.isfinite(block.host_red)


@pytest.mark.parametrize("damage", ["record", "rows", "not_a_group"])
def test_probe_rows_pointing_outside_their_record_are_refused(tmp_path, damage):
    path = _write(tmp_path / "new.h5", s.SCHEMA_VERSION)
    with h5py.File(path, "r+") as f:
        probes = f["probes"][()]
        if damage == "record":
            probes["record"][0] = 10 ** 6
        elif damage == "rows":
            probes["row0"][0] = 10 ** 6
        else:
            clean = np.flatnonzero(f["records"][()]["kind"] == s.KIND_CLEAN)[0]
            probes["record"][0] = clean
        f["probes"][...] = probes
    with pytest.raises(DumpError, match="damaged file"):
        DumpReader(path)


def test_a_group_cut_off_before_its_probe_rows_shows_no_probes(tmp_path):
    """A crash between /records and /probes: the group's probes are simply absent."""
    path = _write(tmp_path / "new.h5", s.SCHEMA_VERSION)
    with h5py.File(path, "r+") as f:
        keep = f["probes"][()]
        last = int(keep["record"].max())
        f["probes"].resize((int((keep["record"] != last).sum()),))
    with DumpReader(path) as rd:
        assert not (rd.group == last).any()
        own = int((rd.stored_records["kind"] != s.KIND_PROBES).sum())
        assert len(rd.records) == own + len(keep) - int((keep["record"] == last).sum())
