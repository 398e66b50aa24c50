"""Schema round trip: writer -> file -> reader, bf16 losslessness, crash consistency."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import h5py
import numpy as np
import pytest

from srdd_dump.format import schema
from srdd_dump.format.reader import DumpError, DumpReader
from srdd_dump.format.writer import DumpWriter, Round, Tensor


def _round(sample, rng, width=16, dtype="float32", layers=3):
    tensors = []
    for layer in range(-1, layers):
        x = rng.standard_normal((2, 5, width)).astype(np.float32)
        if dtype == "bfloat16":
            stored = schema.float32_to_bf16_bits(x)
        else:
            stored = x.astype(schema.STORAGE_DTYPES[dtype])
        tensors.append(Tensor(layer=layer, array=stored, dtype=dtype))
    return Round(sample=sample, step=0, batch=2, seq=5, positions=np.arange(5),
                 token_ids=rng.integers(0, 100, (2, 5)), tensors=tensors)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_round_trip(dtype, tmp_path):
    rng = np.random.default_rng(0)
    rounds = [_round(i, rng, dtype=dtype) for i in range(3)]
    w = DumpWriter(str(tmp_path / "a.h5"), {"model_class": "X"}, ["b.0", "b.1", "b.2"])
    for r in rounds:
        w.submit(r)
    path = w.close()
    assert path.endswith("a.h5") and not (tmp_path / "a.h5.partial").exists()
    with DumpReader(path) as rd:
        assert rd.complete and rd.meta["model_class"] == "X"
        assert rd.layers == ["b.0", "b.1", "b.2"] and rd.n_samples == 3
        for i, r in enumerate(rounds):
            np.testing.assert_array_equal(rd.token_ids(rd.rounds[i]), r.token_ids.reshape(-1))
            for t in r.tensors:
                (rec,) = [x for x in rd.select(t.layer) if x["round"] == i]
                want = schema.decode(t.array, dtype)
                np.testing.assert_array_equal(rd.read(rec), want)
        # a few large datasets, not one per tensor
        assert rd.data_names == [f"clean_{dtype}_16"]
    with h5py.File(path) as f:  # plain h5py sees the documented layout
        assert f.attrs["schema_version"] == schema.SCHEMA_VERSION
        assert f["data"][f"clean_{dtype}_16"].chunks is not None


# a _round tensor is (2, 5, 16) float32: 640 bytes
@pytest.mark.parametrize("join_bytes", [1, 1300, 2000, 1 << 30])
def test_a_rounds_rows_reach_the_file_whole_in_runs_of_any_size(tmp_path, monkeypatch,
                                                                 join_bytes):
    """The writer hands a round's rows to h5py in runs joined in a reused buffer: runs of one
    record, of two or three (the buffer reused within and across rounds), of a whole
    round."""
    from srdd_dump.format import writer

    monkeypatch.setattr(writer, "JOIN_BYTES", join_bytes)
    rng = np.random.default_rng(1)
    rounds = [_round(i, rng, layers=7) for i in range(3)]
    w = DumpWriter(str(tmp_path / "a.h5"), {"model_class": "X"}, [f"b.{i}" for i in range(7)])
    for r in rounds:
        w.submit(r)
    with DumpReader(w.close()) as rd:
        for i, r in enumerate(rounds):
            for t in r.tensors:
                (rec,) = [x for x in rd.select(t.layer) if x["round"] == i]
                np.testing.assert_array_equal(rd.read(rec), t.array)


@pytest.mark.parametrize("version", [4, schema.SCHEMA_VERSION])
def test_a_data_set_sorting_first_that_appears_later_keeps_the_records_right(tmp_path,
                                                                            version):
    """``causal_*`` (a schema-4 probe record) and ``clean_bfloat16_*`` sort before
    ``clean_float32_*``: first written in the second round, the ids of the records already
    written move with them."""
    rng = np.random.default_rng(0)
    rounds = [_round(i, rng) for i in range(3)]
    extra = rng.standard_normal((2, 5, 16)).astype(np.float32)
    rounds[1].tensors.append(Tensor(layer=0, array=extra, dtype="float32",
                                    kind=schema.KIND_CAUSAL))
    rounds[2].tensors.append(Tensor(layer=1, site=0, array=schema.float32_to_bf16_bits(extra),
                                    dtype="bfloat16"))
    w = DumpWriter(str(tmp_path / "a.h5"), {}, ["b.0", "b.1", "b.2"], ["b.1.mlp"],
                   version=version)
    for r in rounds:
        w.submit(r)
    with DumpReader(w.close()) as rd:
        probes = "causal_float32_16" if version < 5 else "probes_float32_16"
        assert rd.data_names == sorted([probes, "clean_bfloat16_16", "clean_float32_16"])
        for i, r in enumerate(rounds):
            for t in r.tensors:
                (rec,) = [x for x in rd.select(t.layer, kind=t.kind, site=t.site)
                          if x["round"] == i]
                np.testing.assert_array_equal(rd.read(rec), schema.decode(t.array, t.dtype))


def test_bf16_codec_is_exact_for_every_bit_pattern():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    f = schema.bf16_bits_to_float32(bits)
    finite = ~np.isnan(f)
    np.testing.assert_array_equal(schema.float32_to_bf16_bits(f[finite]), bits[finite])


def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).standard_normal(10000).astype(np.float32) * 1000
    want = torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(schema.float32_to_bf16_bits(x), want)


def test_crash_keeps_every_flushed_round(tmp_path):
    code = textwrap.dedent(f"""
        import os, time, numpy as np
        from srdd_dump.format.writer import DumpWriter, Round, Tensor
        w = DumpWriter({str(tmp_path / 'c.h5')!r}, {{}}, ["b.0"])
        for i in range(2):
            x = np.full((1, 4, 8), i, np.float32)
            w.submit(Round(sample=i, step=0, batch=1, seq=4, positions=np.arange(4),
                           tensors=[Tensor(layer=0, array=x, dtype="float32")]))
        while w.rounds_written < 2:
            time.sleep(0.01)
        os._exit(9)  # dies without closing the file
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    assert not (tmp_path / "c.h5").exists()
    with DumpReader(str(tmp_path / "c.h5.partial")) as rd:
        assert not rd.complete
        assert len(rd.rounds) == 2
        np.testing.assert_array_equal(rd.read(rd.select(0)[1]), np.ones((1, 4, 8)))


@pytest.mark.parametrize("spare", [0, 100, 100_000])
def test_a_file_size_limit_reached_after_the_last_round_leaves_a_readable_partial(tmp_path,
                                                                                  spare):
    """The real limit (RLIMIT_FSIZE, SIGXFSZ ignored) set just above the file after its last
    round: the closing status is refused before anything is written, so the .partial file
    HDF5 reads back holds every round."""
    code = textwrap.dedent(f"""
        import resource, signal, numpy as np
        from srdd_dump.format.writer import DumpWriter, Round, Tensor
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        w = DumpWriter({str(tmp_path / 'l.h5')!r}, {{}}, ["b.0"], max_pending=0)
        for i in range(2):
            x = np.full((1, 4, 8), i, np.float32)
            w.submit(Round(sample=i, step=0, batch=1, seq=4, positions=np.arange(4),
                           tensors=[Tensor(layer=0, array=x, dtype="float32")]))
        size = __import__("os").path.getsize(w.partial_path)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + {spare}, resource.RLIM_INFINITY))
        print(w.close({{"rounds": 2}}))
        print(w.error)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    path, error = proc.stdout.splitlines()[:2]
    assert path == str(tmp_path / "l.h5.partial") and "closing status" in error
    with DumpReader(path) as rd:
        assert not rd.complete and len(rd.rounds) == 2
        np.testing.assert_array_equal(rd.read(rd.select(0)[1]), np.ones((1, 4, 8)))


CRASHED_WRITER = """
import os, time, numpy as np
from srdd_dump.format import schema
from srdd_dump.format.writer import DumpWriter, Round, StatRow, Tensor
w = DumpWriter({path!r}, {{}}, ["b.0"], sites=["mlp"], stat_columns=["n", "mean"])
for i in range(2):
    x = np.full((1, 4, 8), i, np.float32)
    probes = [Tensor(layer=0, array=x + k, dtype="float32", kind=schema.KIND_GAIN, probe=k)
              for k in range(2)]
    w.submit(Round(sample=i, step=0, batch=1, seq=4, positions=np.arange(4),
                   tensors=[Tensor(layer=0, array=x, dtype="float32"), *probes],
                   stats=[StatRow(layer=0, site=0, dtype=0, values=np.array([4.0, i]))]))
while w.rounds_written < 2:
    time.sleep(0.01)
os._exit(9)
"""


def _grow(ds, rows) -> None:
    ds.resize(ds.shape[0] + len(rows), axis=0)
    ds[-len(rows):] = rows


@pytest.mark.parametrize("cut", [
    "records of a round without its /rounds row", "a /rounds row not written",
    "a /records row not written", "a /probes row not written", "a /stats row not written"])
def test_a_round_cut_off_by_a_crash_is_dropped_whole(cut, tmp_path):
    """What a process killed while writing its third round can leave on disk (HDF5 writes its
    metadata in no set order until the flush): that round's records pointing past the data,
    or a table's new length without its values (a row of zeros, which claims round 0). The
    two finished rounds are read as they were written."""
    code = CRASHED_WRITER.format(path=str(tmp_path / "c.h5"))
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    path = str(tmp_path / "c.h5.partial")
    with DumpReader(path) as rd:
        want = (rd.rounds.copy(), rd.records.copy(), rd.stats_index.copy())
    with h5py.File(path, "r+") as f:
        if cut == "records of a round without its /rounds row":
            cut_off = f[schema.RECORDS][-1:].copy()
            cut_off["round"], cut_off["row0"] = 2, 10_000
            _grow(f[schema.RECORDS], cut_off)
        else:
            table = {"a /rounds row not written": schema.ROUNDS,
                     "a /records row not written": schema.RECORDS,
                     "a /probes row not written": schema.PROBES,
                     "a /stats row not written": schema.STATS_INDEX}[cut]
            _grow(f[table], np.zeros(1, f[table].dtype))
            if table == schema.STATS_INDEX:
                _grow(f[schema.STATS_VALUES], np.zeros((1, 2)))
    with DumpReader(path) as rd:
        assert not rd.complete
        for got, expected in zip((rd.rounds, rd.records, rd.stats_index), want):
            np.testing.assert_array_equal(got, expected)
        assert len(rd.rounds) == 2 and len(rd.stats_index) == 2
        np.testing.assert_array_equal(rd.read(rd.select(0)[1]), np.ones((1, 4, 8)))
    # a file closed by its process is never mended: the same damage there is refused
    finished = str(tmp_path / "d.h5")
    os.rename(path, finished)
    if cut != "a /stats row not written":  # (a stats row of round 0 is a valid row)
        with pytest.raises(DumpError, match="damaged file"):
            DumpReader(finished)


def test_runs_keep_the_order_and_put_an_array_over_the_limit_alone():
    from srdd_dump.format.writer import _runs

    arrays = [np.zeros((n, 4), np.float32) for n in (1, 1, 9, 1, 2, 1, 0, 1)]  # 16 B a row
    runs = list(_runs(arrays, 48))
    assert [[a.shape[0] for a in run] for run in runs] == [[1, 1], [9], [1, 2], [1, 0, 1]]
    assert [a for run in runs for a in run] == arrays


def test_a_write_failing_half_way_through_a_round_leaves_the_earlier_rounds_readable(
        tmp_path, monkeypatch):
    """The round's rows are written in runs after one resize of the data set: a failure after
    the first run (memory, I/O) cuts the data set back, so the file declares no row it does
    not hold and the rounds before are read as written."""
    from srdd_dump.format import writer

    monkeypatch.setattr(writer, "JOIN_BYTES", 1 << 20)
    rng = np.random.default_rng(2)
    w = DumpWriter(str(tmp_path / "h.h5"), {}, [f"b.{i}" for i in range(39)], max_pending=0)
    first = _round(0, rng, layers=39)
    w.submit(first)
    # 40 records of 256 KB: the failed round's rows reach chunks the file never allocated
    big = Round(sample=1, step=0, batch=2, seq=2000, positions=np.arange(2000),
                token_ids=None, tensors=[
                    Tensor(layer=layer, array=rng.standard_normal((2, 2000, 16)).astype(
                        np.float32), dtype="float32") for layer in range(-1, 39)])
    calls = []
    joined = writer._H5File._joined

    def fails_second_time(self, arrays):
        calls.append(len(arrays))
        if len(calls) == 2:
            raise MemoryError("cannot allocate")
        return joined(self, arrays)

    monkeypatch.setattr(writer._H5File, "_joined", fails_second_time)
    w.submit(big)
    assert "cannot allocate" in w.error and len(calls) == 2
    with DumpReader(w.close()) as rd:
        assert len(rd.rounds) == 1
        for t in first.tensors:
            (rec,) = rd.select(t.layer)
            np.testing.assert_array_equal(rd.read(rec), t.array)


def test_a_status_that_does_not_fit_leaves_the_rounds_in_a_partial_file(tmp_path,
                                                                        monkeypatch):
    """Another process fills the disk after the last round: the closing status would not fit.
    Nothing more is written and every round was flushed, so the file is kept as a crash
    between rounds leaves it (.partial, read as cut short), not set aside as broken."""
    from srdd_dump.format import writer

    rng = np.random.default_rng(3)
    w = DumpWriter(str(tmp_path / "s.h5"), {}, ["b.0"], max_pending=0)
    rounds = [_round(i, rng, layers=1) for i in range(2)]
    for r in rounds:
        w.submit(r)

    def full(self, need, size, what="the next round"):
        raise writer.NoRoom(f"no room for {what}: 0.00 MB free")

    monkeypatch.setattr(writer._H5File, "_check_room", full)
    path = w.close({"rounds": 2})
    assert path == str(tmp_path / "s.h5.partial") and "closing status: 0.00 MB" in w.error
    assert not (tmp_path / "s.h5").exists() and not (tmp_path / "s.h5.broken").exists()
    with DumpReader(path) as rd:
        assert len(rd.rounds) == 2 and not rd.complete
        for i, r in enumerate(rounds):
            for t in r.tensors:
                (rec,) = [x for x in rd.select(t.layer) if x["round"] == i]
                np.testing.assert_array_equal(rd.read(rec), t.array)


def test_write_failure_is_kept_not_raised(tmp_path, monkeypatch):
    w = DumpWriter(str(tmp_path / "e.h5"), {}, ["b.0"])
    rng = np.random.default_rng(0)
    w.submit(_round(0, rng, layers=1))
    while w.rounds_written < 1:
        time.sleep(0.01)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(w._file, "write_round", full)
    w.submit(_round(1, rng, layers=1))
    w.submit(_round(2, rng, layers=1))  # dropped, never raises
    path = w.close()
    assert "No space left" in w.error
    with DumpReader(path) as rd:
        assert len(rd.rounds) == 1 and not rd.complete
        assert "No space left" in rd.status["write_error"]
