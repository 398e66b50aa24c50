"""Bad input, fuzzed (issue 7): whatever the dump files hold, srdd-compare ends in a report or in
exit code 2 with one line: never a traceback, a hang or an out-of-memory.

The files start from real dumps of the tiny llama (and a tiny 3-layer gpt2 as "a different
model"), captured once per module. Files that h5py itself writes (missing parts, wrong types,
absurd shapes, NaN/Inf) are compared in this process; byte-level damage (random bytes,
truncation, flipped bits), which reaches parts of the HDF5 library that are not safe against
hostile input, runs in a sandbox: a worker that forks one supervised child per file, exactly
as the srdd-compare command does, under an address-space limit.
"""

from __future__ import annotations

import json
import os
import re
import resource
import select
import shutil
import string
import subprocess
import sys
import tempfile
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from srdd_dump import DumpConfig, register_hook
from srdd_dump.errors import UserError
from srdd_dump.format import schema as s
from srdd_dump.format.reader import DumpReader

from capture_utils import ROOT, run_cli
from dumpfactory import baseline_written as compare_baseline
from dumpfactory import compare_written as compare_path
from dumpfactory import normal_rounds, write_dump
from tiny_models import build

pytestmark = pytest.mark.integration

FUZZ = settings(
    max_examples=40, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
FEWER = settings(FUZZ, max_examples=25)  # each example also runs the baseline mode
MAX_ALLOCATED = 200 << 20  # the dumps are ~3 MB: no example needs more than this at once


# -- the real dumps ------------------------------------------------------------------------


def _capture(arch: str, folder: str, layers: int) -> str:
    model = build(arch, layers=layers)
    gen = torch.Generator().manual_seed(3)
    config = DumpConfig(dump_path=folder, samples=2, steps="0,1", progress=False)
    # the file's meta holds the command line and the dump's folder: both of one length
    # whatever pytest was asked, so that the layout of the file's string heap (_heap_hang) is
    # the same in every run
    argv, sys.argv = sys.argv, ["pytest"]
    try:
        with register_hook(model, config) as session, torch.no_grad():
            for n in (9, 6):
                ids = torch.randint(0, 128, (1, n), generator=gen)
                model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    finally:
        sys.argv = argv
    return session.path


@pytest.fixture(scope="module")
def dumps() -> Iterator[dict]:
    # a folder name of one length (a pytest temporary folder's number grows between runs)
    root = Path(tempfile.mkdtemp(prefix="srdd-fuzz-"))
    try:
        yield _dumps(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _dumps(root: Path) -> dict:
    llama = _capture("llama", str(root / "llama"), 4)
    gpt2 = _capture("gpt2", str(root / "gpt2"), 3)  # same prompts, another model and depth
    narrow = write_dump(str(root / "narrow" / "n.h5"),
                        normal_rounds(np.random.default_rng(0), layers=(-1, 0, 1, 2, 3)))
    work = root / "work"
    work.mkdir()
    with DumpReader(llama) as r:
        assert r.complete and r.n_samples == 2 and len(r.rounds) == 4
        kinds = {s.KIND_NAMES[int(k)] for k in r.records["kind"]}
        assert {"clean", "gain", "dc", "repeat", "replay"} <= kinds
        assert not {"gain", "dc", "repeat", "replay"} & {n.split("_")[0] for n in r.data_names}
    return {"llama": llama, "gpt2": gpt2, "narrow": narrow, "work": work,
            "blob": open(llama, "rb").read()}


def _case(dumps) -> str:
    path = str(dumps["work"] / "case.h5")
    with open(path, "wb") as fh:
        fh.write(dumps["blob"])
    return path


@contextmanager
def _capped(extra: int = 2 << 30) -> Iterator[None]:
    """Address space limited to what the process maps now plus ``extra``: a runaway allocation
    becomes a MemoryError (a failed example) instead of the OOM killer's business."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        with open("/proc/self/statm") as fh:
            mapped = int(fh.read().split()[0]) * resource.getpagesize()
    except OSError:  # not Linux: no cap
        yield
        return
    cap = mapped + extra if hard == resource.RLIM_INFINITY else min(hard, mapped + extra)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _compare(path: str, output: str | None = None):
    """compare_path in this process: a report, or a UserError of one line naming the file.
    Any other exception fails the test, and so does a peak of more than MAX_ALLOCATED bytes
    (numpy arrays, h5py reads included, are traced)."""
    tracemalloc.start()
    try:
        with _capped():
            result = compare_path(path, output, progress=False)
    except UserError as exc:
        text = str(exc)
        assert text and "\n" not in text and path in text, text
        result = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < MAX_ALLOCATED, f"{peak} bytes allocated at the peak"
    return result


def _objects(path: str) -> list[str]:
    with h5py.File(path, "r") as f:
        names: list[str] = []
        f.visit(names.append)
    return sorted(names)


# -- missing groups and attributes -----------------------------------------------------------

REQUIRED = {s.LAYERS, s.ROUNDS, s.RECORDS, s.DATA}


@st.composite
def removals(draw, objects: list[str]) -> list[tuple[str, str]]:
    data = [o for o in objects if o.startswith(s.DATA + "/")]
    one = st.one_of(
        st.sampled_from(objects).map(lambda o: ("object", o)),
        st.sampled_from([s.ATTR_FORMAT, s.ATTR_VERSION, s.ATTR_META, s.ATTR_STATUS,
                         s.ATTR_COMPLETE]).map(lambda a: ("attr", a)),
        st.sampled_from(data).map(lambda o: ("dtype_attr", o)),
        st.sampled_from([(t, n) for t, dt in ((s.ROUNDS, s.ROUND_DTYPE),
                                              (s.RECORDS, s.RECORD_DTYPE))
                         for n in dt.names]).map(lambda tn: ("field", f"{tn[0]}:{tn[1]}")),
    )
    return draw(st.lists(one, min_size=1, max_size=3))


def _drop_field(f: h5py.File, table: str, field: str) -> None:
    rows = f[table][()]
    keep = [n for n in rows.dtype.names if n != field]
    del f[table]
    f.create_dataset(table, data=rows[keep].astype([(n, rows.dtype[n]) for n in keep]),
                     maxshape=(None,), chunks=True)


def test_missing_groups_attributes_and_fields(dumps):
    objects = _objects(dumps["llama"])

    @FUZZ
    @given(removals(objects))
    def check(ops):
        path = _case(dumps)
        with h5py.File(path, "r+") as f:
            for kind, what in ops:
                if kind == "object" and what in f:
                    del f[what]
                elif kind == "attr" and what in f.attrs:
                    del f.attrs[what]
                elif kind == "dtype_attr" and what in f and s.ATTR_DTYPE in f[what].attrs:
                    del f[what].attrs[s.ATTR_DTYPE]
                elif kind == "field":
                    table, field = what.split(":")
                    if table in f and field in (f[table].dtype.names or ()):
                        _drop_field(f, table, field)
        result = _compare(path)
        required_gone = any(
            (k == "object" and w in REQUIRED) or (k == "attr" and w in ("format", "schema_version"))
            or k == "field" for k, w in ops
        )
        if required_gone:
            assert result is None, ops

    check()


# -- wrong dtypes ----------------------------------------------------------------------------

ATTR_VALUES = {
    s.ATTR_FORMAT: [1, b"srdd-dump", np.array(["srdd-dump", "srdd-dump"], dtype=object), "x"],
    s.ATTR_VERSION: ["1", 1.5, np.array([1, 1]), True, -3, 0, 2**40],
    s.ATTR_META: ["[1, 2]", "not json", 5, '{"rank": Infinity, "pid": NaN, "hidden_dtype": 3}',
                  '{"layers": {"a": 1}, "hidden_dtype": "int8"}', "{" * 5000],
    s.ATTR_STATUS: ['"text"', "null", '{"error": {"nested": [1]}}'],
    s.ATTR_COMPLETE: ["yes", np.array([1, 1]), 2.5, -1],
}
DATASET_TYPES = ["i1", "u8", "f2", "f8", "S8", "str", "ref", "compound", "2d"]


def _replace(f: h5py.File, name: str, kind: str) -> None:
    old = f[name]
    n = max(1, old.shape[0] if old.shape else 1)
    del f[name]
    if kind == "str":
        f.create_dataset(name, data=np.array(["x"] * n, dtype=object), dtype=h5py.string_dtype())
    elif kind == "ref":
        f.create_dataset(name, data=[f.ref] * n, dtype=h5py.ref_dtype)
    elif kind == "compound":
        f.create_dataset(name, data=np.zeros(n, dtype=[("a", "<i4"), ("b", "<f8")]))
    elif kind == "2d":
        f.create_dataset(name, data=np.ones((n, 3), dtype="<f4"))
    else:
        f.create_dataset(name, data=np.ones(n, dtype=kind))


def _retype_field(f: h5py.File, table: str, field: str, dtype: str) -> None:
    rows = f[table][()]
    new = [(n, dtype if n == field else rows.dtype[n]) for n in rows.dtype.names]
    out = np.zeros(len(rows), dtype=new)
    for n in rows.dtype.names:
        out[n] = rows[n].astype(dtype) if n == field and dtype != "O" else rows[n]
    del f[table]
    f.create_dataset(table, data=out)


def test_wrong_dtypes(dumps):
    objects = [o for o in _objects(dumps["llama"]) if o != s.DATA]
    fields = [(t, n) for t, dt in ((s.ROUNDS, s.ROUND_DTYPE), (s.RECORDS, s.RECORD_DTYPE))
              for n in dt.names]
    op = st.one_of(
        st.sampled_from([("attr", a, i) for a in sorted(ATTR_VALUES)
                         for i in range(len(ATTR_VALUES[a]))]),
        st.tuples(st.just("dataset"), st.sampled_from(objects), st.sampled_from(DATASET_TYPES)),
        st.tuples(st.just("field"), st.sampled_from(fields),
                  st.sampled_from(["f4", "f8", "i1", "u8", "i8", "?"])),
        st.tuples(st.just("data_attr"), st.sampled_from(
            [o for o in objects if o.startswith(s.DATA + "/")]),
            st.sampled_from(["int8", "bfloat16", "float16", "float64", "", "float32"])),
    )

    @FUZZ
    @given(st.lists(op, min_size=1, max_size=2))
    def check(ops):
        path = _case(dumps)
        with h5py.File(path, "r+") as f:
            for o in ops:
                if o[0] == "attr":
                    f.attrs[o[1]] = ATTR_VALUES[o[1]][o[2]]
                elif o[0] == "dataset" and o[1] in f:
                    _replace(f, o[1], o[2])
                elif o[0] == "field" and o[1][0] in f:
                    if o[1][1] in (f[o[1][0]].dtype.names or ()):
                        _retype_field(f, o[1][0], o[1][1], o[2])
                elif o[0] == "data_attr" and o[1] in f:
                    f[o[1]].attrs[s.ATTR_DTYPE] = o[2]
        _compare(path)

    check()


def test_object_and_reference_datasets_are_refused_not_followed(dumps):
    """Nothing in a dump is ever turned into Python objects beyond numbers and strings."""
    for name, kind in ((s.LAYERS, "ref"), (s.RECORDS, "ref"), (s.ROUNDS, "str")):
        path = _case(dumps)
        with h5py.File(path, "r+") as f:
            _replace(f, name, kind)
        with pytest.raises(UserError, match=f"/{name} "):
            compare_path(path, progress=False)
    path = _case(dumps)
    with h5py.File(path, "r+") as f:  # a data set of variable-length (object) values
        name = sorted(f[s.DATA])[0]
        attrs = dict(f[s.DATA][name].attrs)
        del f[s.DATA][name]
        ds = f[s.DATA].create_dataset(name, (4, 64), dtype=h5py.vlen_dtype(np.dtype("<f4")))
        ds.attrs.update(attrs)
    with pytest.raises(UserError, match="unexpected shape or dtype"):
        compare_path(path, progress=False)


# -- absurd declared shapes ------------------------------------------------------------------

HUGE = [-1, -(2**31), 2**31 - 1, 10**12, 2**62, -(2**62)]
RECORD_FIELDS = ["row0", "nrows", "batch", "ntok", "width", "data", "layer", "site", "round"]
ROUND_FIELDS = ["pos_off", "ntok", "tok_off", "tok_len", "prow_off", "prow_len", "batch",
                "seq", "sample", "step", "round"]


def test_absurd_shapes_are_refused_without_allocating(dumps):
    names = _objects(dumps["llama"])
    data = [n for n in names if n.startswith(s.DATA + "/")]
    op = st.one_of(
        st.tuples(st.just(s.RECORDS), st.sampled_from(RECORD_FIELDS), st.sampled_from(HUGE),
                  st.booleans()),
        st.tuples(st.just(s.ROUNDS), st.sampled_from(ROUND_FIELDS), st.sampled_from(HUGE),
                  st.booleans()),
        st.tuples(st.just("resize"), st.sampled_from(data + [s.RECORDS, s.ROUNDS, s.TOKEN_IDS,
                                                            s.POSITIONS, s.PROBE_ROWS]),
                  st.sampled_from([10**6, 10**7, 10**9, 2**40]), st.just(False)),
    )

    @FUZZ
    @given(st.lists(op, min_size=1, max_size=2))
    def check(ops):
        path = _case(dumps)
        with _capped(), h5py.File(path, "r+") as f:
            # resizes last: the edits read a whole table, which must not be a resized one
            for target, field, value, one_row in sorted(ops, key=lambda o: o[0] == "resize"):
                if target == "resize":
                    ds = f[field]
                    ds.resize(value, axis=0)  # unallocated chunks: the file stays small
                    continue
                rows = f[target][()]
                info = np.iinfo(rows.dtype[field])
                clipped = int(np.clip(value, info.min, info.max))
                if one_row:
                    rows[field][len(rows) // 2] = clipped
                else:
                    rows[field] = clipped
                f[target][...] = rows
        assert os.path.getsize(path) < 10 * len(dumps["blob"])
        _compare(path)

    check()


# -- NaN / Inf ---------------------------------------------------------------------------------

SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 3e38, 1e-45, 1e30]


def test_nonfinite_tensors_still_give_a_report(dumps):
    names = [n for n in _objects(dumps["llama"]) if n.startswith(s.DATA + "/")]
    clean = [n for n in names if n.split("/")[1].startswith("clean")]

    @FEWER
    @given(st.lists(st.tuples(st.sampled_from(names), st.sampled_from(SPECIAL),
                              st.floats(0.0, 1.0), st.integers(0, 2**32 - 1)),
                    min_size=1, max_size=3),
           st.booleans())
    def check(fills, xlsx):
        path = _case(dumps)
        with h5py.File(path, "r+") as f:
            for name, value, frac, seed in fills:
                ds = f[name]
                x = ds[()].astype(np.float32)
                if ds.attrs[s.ATTR_DTYPE] == "bfloat16":
                    x = s.bf16_bits_to_float32(ds[()])
                mask = np.random.default_rng(seed).random(x.shape) < frac
                x[mask] = value
                ds[...] = (s.float32_to_bf16_bits(x) if ds.attrs[s.ATTR_DTYPE] == "bfloat16"
                           else x.astype(ds.dtype))
        out = str(dumps["work"] / ("r.xlsx" if xlsx else "r.csv"))
        result = _compare(path, out)
        assert result is not None, "a file with NaN/Inf values is still a valid dump"
        if any(n in clean and np.isnan(v) and frac == 1.0 for n, v, frac, _ in fills):
            assert result.layers["nan_count"].sum() > 0
        table = compare_baseline(path, dumps["llama"], progress=False).table
        assert len(table)

    check()


# -- metadata --------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(string.printable, max_size=20),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(string.ascii_letters, max_size=8), inner, max_size=4),
    max_leaves=12,
)
META_KEYS = ["rank", "pid", "hidden_dtype", "layers", "world_size", "model_class", "device"]


def test_any_metadata_values(dumps):
    @FEWER
    @given(st.dictionaries(st.sampled_from(META_KEYS) | st.text(string.ascii_letters, max_size=6),
                           JSON, max_size=6),
           st.sampled_from([s.ATTR_META, s.ATTR_STATUS]))
    @example({"rank": 2.0**64, "pid": 2**63}, s.ATTR_META)  # found: an int64 column overflowed
    def check(meta, attr):
        path = _case(dumps)
        with h5py.File(path, "r+") as f:
            f.attrs[attr] = json.dumps(meta)
        assert _compare(path) is not None
        compare_baseline(path, dumps["llama"], progress=False)

    check()


# -- a baseline from a different model -------------------------------------------------------


def test_baseline_from_a_different_model_gives_a_report(dumps, tmp_path):
    for mine, golden in (("llama", "gpt2"), ("gpt2", "llama"), ("llama", "narrow")):
        result = compare_baseline(dumps[mine], dumps[golden], str(tmp_path / "b.xlsx"),
                                  progress=False)
        assert len(result.table) and result.written
        reasons = " ".join(result.table["cmp_fail_reason"])
        if golden == "narrow":
            assert "shape mismatch" in reasons or "inputs differ" in reasons
        else:  # 4 llama blocks against 3 gpt2 blocks: one layer has no counterpart
            assert "no counterpart" in reasons
    proc = run_cli("srdd-compare", os.path.dirname(dumps["llama"]), "--baseline",
                   os.path.dirname(dumps["gpt2"]), "-o", str(tmp_path / "b.csv"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and (tmp_path / "b.csv").exists()


# -- byte-level damage, in the sandbox ---------------------------------------------------------

WORKER = r"""
import io, json, resource, sys, traceback
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from srdd_dump.compare import compare_path
from srdd_dump.errors import UserError
from srdd_dump.format.reader import set_read_monitor
from srdd_dump.runtime.watchdog import arm, supervise

def one(req):
    set_read_monitor(arm(req["read_timeout"]))  # as the srdd-compare command does
    try:
        result = compare_path(req["path"], progress=False)
        out = {"kind": "report", "status": list(result.files["status"])}
    except UserError as exc:
        out = {"kind": "exit2", "message": str(exc)}
    except BaseException:
        out = {"kind": "crash", "message": traceback.format_exc()}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0

for line in sys.stdin:
    req = json.loads(line)
    err, sys.stderr = sys.stderr, io.StringIO()
    try:
        code = supervise(lambda: one(req), "srdd-compare")
        text = sys.stderr.getvalue()
    finally:
        sys.stderr = err
    if code:
        sys.stdout.write(json.dumps({"kind": "exit", "code": code, "message": text}) + "\n")
        sys.stdout.flush()
"""


class Sandbox:
    """One worker process; each file is compared in a forked, supervised child."""

    def __init__(self, read_timeout: float = 5.0, deadline: float = 60.0):
        self.read_timeout, self.deadline = read_timeout, deadline
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        return subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env=env, cwd=ROOT)

    def compare(self, path: str) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        self.proc.stdin.write(json.dumps({"path": path, "read_timeout": self.read_timeout})
                              + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.deadline)
        if not ready:
            self.close()
            return {"kind": "hang"}
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            self.proc = None
            return {"kind": "worker died", "code": code}
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(scope="module")
def sandbox():
    box = Sandbox()
    yield box
    box.close()


def _check_outcome(out: dict, path: str) -> None:
    """A report, or one line (exit 2): from compare itself or from the stall guard."""
    if out["kind"] == "report":
        return
    if out["kind"] == "exit2":
        assert "\n" not in out["message"] and path in out["message"], out
        return
    if out["kind"] == "exit":  # the child hung or crashed inside HDF5 and was stopped
        assert out["code"] == 2, out
        lines = out["message"].strip().splitlines()
        assert len(lines) == 1 and re.search(r"reading stalled|crashed with", lines[0]), out
        return
    pytest.fail(f"{out['kind']}: {out.get('message', out)}")


def _data_ranges(path: str) -> list[tuple[int, int]]:
    """Byte ranges of the tensor chunks under /data; everything else is structure."""
    ranges = []
    with h5py.File(path, "r") as f:
        for name in f[s.DATA]:
            ds = f[s.DATA][name]
            for i in range(ds.id.get_num_chunks()):
                info = ds.id.get_chunk_info(i)
                ranges.append((info.byte_offset, info.byte_offset + info.size))
    return ranges


def test_random_bytes(dumps, sandbox):
    @FUZZ
    @given(st.binary(max_size=4096), st.sampled_from([b"", b"\x89HDF\r\n\x1a\n"]))
    def check(blob, head):
        path = str(dumps["work"] / "bytes.h5")
        with open(path, "wb") as fh:
            fh.write(head + blob)
        out = sandbox.compare(path)
        assert out["kind"] in ("exit2", "exit"), out
        _check_outcome(out, path)

    check()


def test_truncated_files(dumps, sandbox):
    blob = dumps["blob"]

    @FUZZ
    @given(st.integers(0, len(blob) - 1))
    def check(cut):
        path = str(dumps["work"] / "cut.h5.partial")
        with open(path, "wb") as fh:
            fh.write(blob[:cut])
        _check_outcome(sandbox.compare(path), path)

    check()


def test_flipped_bits(dumps, sandbox):
    blob = dumps["blob"]
    data = _data_ranges(dumps["llama"])
    inside = np.zeros(len(blob), dtype=bool)
    for a, b in data:
        inside[a:b] = True
    structure = np.flatnonzero(~inside)  # metadata, heaps, b-trees and the index tables
    position = st.one_of(
        st.integers(0, len(structure) - 1).map(lambda i: int(structure[i])),
        st.integers(0, len(blob) - 1),
    )

    @FUZZ
    @given(st.lists(st.tuples(position, st.integers(0, 7)), min_size=1, max_size=8))
    def check(flips):
        damaged = bytearray(blob)
        for pos, bit in flips:
            damaged[pos] ^= 1 << bit
        path = str(dumps["work"] / "flipped.h5")
        with open(path, "wb") as fh:
            fh.write(damaged)
        _check_outcome(sandbox.compare(path), path)

    check()


def _heap_hang(blob: bytes) -> bytes:
    """Damage the global heap that holds the root's string attributes so that HDF5 loops
    forever reading it (seen with one flipped bit): an object's size is changed so that the
    next object header lands in the zero-filled free space, a header of size 0."""
    out = bytearray(blob)
    gcol = blob.index(b"GCOL")
    size = int.from_bytes(blob[gcol + 8 : gcol + 16], "little")
    pos, headers = gcol + 16, []
    while pos < gcol + size:
        index = int.from_bytes(blob[pos : pos + 2], "little")
        length = int.from_bytes(blob[pos + 8 : pos + 16], "little")
        headers.append((pos, index, length))
        if index == 0:
            break
        pos += 16 + (length + 7) // 8 * 8
    first, free = headers[0], headers[-1]
    # the free space's zeros start right after its 16-byte header (how many there are depends
    # on the length of the root's strings: the paths and versions of the machine)
    assert free[1] == 0 and free[2] >= 24
    target = free[0] + 16  # 8-aligned and inside the free space's zeros
    out[first[0] + 8 : first[0] + 16] = (target - first[0] - 16).to_bytes(8, "little")
    return bytes(out)


def test_a_hang_inside_hdf5_ends_in_one_line(dumps, tmp_path):
    path = tmp_path / "hang.h5"
    path.write_bytes(_heap_hang(dumps["blob"]))
    proc = run_cli("srdd-compare", str(path), "-o", str(tmp_path / "r.csv"),
                   "--read-timeout", "2", timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "reading stalled for 2 s" in lines[0]


# -- the command line, end to end --------------------------------------------------------------


@pytest.mark.parametrize("case", ["random", "truncated", "huge_records", "huge_data", "nan"])
def test_cli_bad_input_is_one_line_or_a_report(case, dumps, tmp_path):
    path = tmp_path / "in.h5"
    blob = dumps["blob"]
    if case == "random":
        path.write_bytes(b"\x89HDF\r\n\x1a\n" + np.random.default_rng(0).bytes(3000))
    elif case == "truncated":
        path.write_bytes(blob[: len(blob) * 2 // 3])
    else:
        path.write_bytes(blob)
        with h5py.File(path, "r+") as f:
            if case == "huge_records":
                rows = f[s.RECORDS][()]
                rows["nrows"] = 10**12
                f[s.RECORDS][...] = rows
            elif case == "huge_data":
                for name in f[s.DATA]:
                    f[s.DATA][name].resize(10**9, axis=0)
            else:
                for name in f[s.DATA]:
                    f[s.DATA][name][...] = np.nan
    out = tmp_path / "r.xlsx"
    proc = run_cli("srdd-compare", str(path), "-o", str(out), timeout=120)
    assert "Traceback" not in proc.stderr
    if case == "nan":
        assert proc.returncode == 0, proc.stderr
        assert out.exists()
    else:
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("srdd-compare: error: ") and str(path) in lines[0]
        assert not out.exists()


def test_sandbox_reports_a_stall(dumps, tmp_path):
    """The sandbox itself: a file whose reading stalls is reported as the one-line stall."""
    path = str(tmp_path / "hang.h5")
    with open(path, "wb") as fh:
        fh.write(_heap_hang(dumps["blob"]))
    box = Sandbox(read_timeout=1.0)
    try:
        out = box.compare(path)
    finally:
        box.close()
    assert out["kind"] == "exit" and out["code"] == 2 and "reading stalled" in out["message"]


CRASH = """
import os, signal, sys
from srdd_dump.runtime.watchdog import arm, supervise, _publish
def run():
    arm(5)
    _publish({path!r})  # as the reader does when an HDF5 call starts
    os.kill(os.getpid(), signal.SIGSEGV)
sys.exit(supervise(run, "srdd-compare"))
"""


def test_a_crash_inside_hdf5_ends_in_one_line(tmp_path):
    """libhdf5 is not hardened against hostile files; if it ever crashes, srdd-compare still
    ends with exit code 2 and one line naming the file."""
    path = str(tmp_path / "x.h5")
    proc = subprocess.run([sys.executable, "-c", CRASH.format(path=path)], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"srdd-compare: error: {path}: crashed with SIGSEGV inside the HDF5 library "
        "(a damaged file?)"
    ]


def test_fixture_dump_is_intact(dumps):
    shutil.copy(dumps["llama"], dumps["work"] / "intact.h5")
    result = _compare(str(dumps["work"] / "intact.h5"))
    assert result is not None and list(result.files["status"]) == ["ok"]
