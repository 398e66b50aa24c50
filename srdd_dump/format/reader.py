"""Reader of dump files of every schema version (format/schema.py). numpy + h5py only (no
torch, no pickle).

Every file is checked against the schema before anything is read, and the check is what keeps
damaged or hostile files harmless: data sets must be plain numbers (no object, reference or
variable-length types beyond the string lists), every offset and length must point inside its
data set, and no data set may declare more data than the file actually stores, so a forged
shape can never make the reader allocate memory for data that is not there.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

import h5py
import numpy as np

from ..errors import first_line
from . import schema as s
from .direct import ChunkRows, open_file

# A data set may declare this much more than the file stores (a chunk being written at a crash).
_STORAGE_SLACK = 1 << 20
# Compressed data sets (a file repacked with h5repack) may hold this ratio: gzip's limit.
_MAX_COMPRESSION = 1100
_NUMBER_KINDS = "biuf"

# Called with a file's path before each HDF5 access and with None after it; set by the CLI to
# srdd_dump.runtime.watchdog's monitor, so that another process can see an access that hangs.
_monitor: Callable[[str | None], None] | None = None


def set_read_monitor(monitor: Callable[[str | None], None] | None) -> None:
    global _monitor
    _monitor = monitor


@contextmanager
def _reading(path: str) -> Iterator[None]:
    monitor = _monitor
    if monitor is None:
        yield
        return
    monitor(path)
    try:
        yield
    finally:
        monitor(None)


class DumpError(Exception):
    """A dump file that cannot be read; the message is one line meant for the user."""


def find_dump_files(path: str) -> list[str]:
    """All dump files (finished and partial) under a file or folder, sorted."""
    if os.path.isfile(path):
        return [path]
    found = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(s.FILE_SUFFIX) or name.endswith(s.FILE_SUFFIX + s.PARTIAL_SUFFIX):
                found.append(os.path.join(root, name))
    return found


class DumpReader:
    """Open a dump file and check it against the schema before anything is read.

    Attributes: ``meta`` (dict), ``layers`` (names), ``rounds`` and ``records`` (structured
    arrays in the schema's dtypes), ``complete`` (False for a file cut short by a crash),
    ``status`` (dict).

    ``records`` has one row per tensor in every schema version: a schema-5 file's KIND_PROBES
    records (a site's probe outputs of a round, described in /probes) are shown as the
    per-probe records an older file stores, each pointing at its rows of the group, so every
    reader of records reads both layouts alike. ``group`` gives each row's KIND_PROBES record
    (an index into ``stored_records``, the /records table as stored; -1: a record of its own).
    """

    def __init__(self, path: str):
        self.path = path
        if path.endswith(s.BROKEN_SUFFIX):
            raise DumpError(
                f"{path}: set aside by srdd-dump after a write failed half-way (disk full?); "
                "its content is not trusted"
            )
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = None  # h5py says why it cannot open it
        if mode is not None and not stat.S_ISREG(mode):  # a FIFO would wait for a writer
            raise DumpError(f"{path}: not a regular file (a named pipe, socket or device "
                            "named like a dump file)")
        with _reading(path):
            try:
                self.f = h5py.File(path, "r")
            except Exception as exc:
                if "unable to lock file" in str(exc) and (
                        "errno = 11" in str(exc) or "Errno 11" in str(exc)
                        or "temporarily unavailable" in str(exc)):  # a writer holds it open
                    raise DumpError(
                        f"{path}: still being written (the capture writing it holds it open): "
                        "compare it once the run has ended, or in code once the hook is "
                        "closed (the end of its with block, or .close())") from exc
                raise DumpError(f"{path}: not a readable HDF5 file ({first_line(exc)})") from exc
            try:
                self._validate()
            except DumpError:
                self.f.close()
                raise
            except Exception as exc:  # corrupt internals surface as many h5py error types
                self.f.close()
                raise DumpError(f"{path}: damaged dump file ({first_line(exc)})") from exc

    def _validate(self) -> None:
        f, path = self.f, self.path
        if _attr_text(f, s.ATTR_FORMAT) != s.FORMAT_NAME:
            raise DumpError(f"{path}: not an srdd-dump file (no format attribute)")
        version = f.attrs.get(s.ATTR_VERSION)
        if not isinstance(version, (int, np.integer)) or isinstance(version, (bool, np.bool_)):
            raise DumpError(f"{path}: schema_version attribute missing or not an integer")
        if version > s.SCHEMA_VERSION:
            raise DumpError(
                f"{path}: schema version {version} is newer than this srdd-compare reads "
                f"({s.SCHEMA_VERSION}); upgrade srdd-dump"
            )
        if version < 1:
            raise DumpError(f"{path}: unknown schema version {version}")
        for name in (s.LAYERS, s.ROUNDS, s.RECORDS, s.DATA):
            if name not in f:
                raise DumpError(f"{path}: missing /{name}")
        self.meta = self._json_attr(s.ATTR_META)
        self.status = self._json_attr(s.ATTR_STATUS)
        complete = f.attrs.get(s.ATTR_COMPLETE, 0)
        self.complete = (
            isinstance(complete, (int, np.integer)) and bool(complete)
            and not path.endswith(s.PARTIAL_SUFFIX)
        )
        self.layers = self._names(s.LAYERS)
        self.sites = self._names(s.SITES) if s.SITES in f else []
        self.rounds = self._table(s.ROUNDS, s.ROUND_DTYPE)
        self.stored_records = self._table(s.RECORDS, s.RECORD_DTYPE)
        self.version = int(version)
        probes = (self._table(s.PROBES, s.PROBE_DTYPE) if version >= 5 and s.PROBES in f
                  else np.zeros(0, s.PROBE_DTYPE))
        data = f[s.DATA]
        if not isinstance(data, h5py.Group):
            raise DumpError(f"{path}: /{s.DATA} is not a group")
        self.data_names = sorted(data.keys())
        self._data = []
        for name in self.data_names:
            ds = data.get(name)
            dtype = _attr_text(ds, s.ATTR_DTYPE) if isinstance(ds, h5py.Dataset) else None
            if (
                dtype not in s.STORAGE_DTYPES or ds.ndim != 2 or ds.shape[1] < 1
                or ds.dtype != s.STORAGE_DTYPES[dtype]
            ):
                raise DumpError(f"{path}: /data/{name} has an unexpected shape or dtype")
            self._check_stored(ds)
            self._data.append((ds, dtype))
        lengths = {
            name: self._index_length(name)
            for name in (s.POSITIONS, s.TOKEN_IDS, s.PROBE_ROWS)
        }
        self.partial = path.endswith(s.PARTIAL_SUFFIX)  # its process died before closing it
        if self.partial:
            probes = self._without_cut_round(lengths, probes)
        self._check_rounds(lengths)
        stored = self.stored_records
        grouped = stored["kind"] == s.KIND_PROBES
        if version < 5 and grouped.any():
            raise DumpError(f"{path}: grouped probe records in a schema-{version} file "
                            "(damaged file)")
        self._check_records(stored, shapes=~grouped)
        self.records, self.group = self._expand(stored, grouped, probes)
        self._check_records(self.records)
        self.stat_columns: list[str] = []
        self.stats_index = np.zeros(0, s.STATS_INDEX_DTYPE)
        self._stats_values: h5py.Dataset | None = None
        if s.STATS in f:
            self._read_stats_index()

    def _read_stats_index(self) -> None:
        """/stats (--store stats): the index table, and the values' shape and column names."""
        index = self._table(s.STATS_INDEX, s.STATS_INDEX_DTYPE)
        values = self.f.get(s.STATS_VALUES)
        if not isinstance(values, h5py.Dataset) or values.ndim != 2 or values.dtype.kind != "f":
            raise DumpError(f"{self.path}: /{s.STATS_VALUES} is not a two-dimensional float "
                            "data set")
        self._check_stored(values)
        try:
            columns = json.loads(_attr_text(values, s.ATTR_COLUMNS) or "")
        except ValueError:
            columns = None
        if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns) \
                or len(columns) != values.shape[1]:
            raise DumpError(f"{self.path}: /{s.STATS_VALUES} has no valid column names")
        if self.partial:  # the rows of a round cut off by a crash (_without_cut_round)
            index = index[:values.shape[0]]
            index = index[:_in_order(index["round"], np.isin(index["round"],
                                                             self.rounds["round"]))]
        bad = (
            (index["layer"] < s.STACK_INPUT) | (index["layer"] >= len(self.layers))
            | (index["site"] < s.BLOCK_SITE) | (index["site"] >= len(self.sites))
            | (index["dtype"] >= len(s.DTYPE_CODES))
        )
        if values.shape[0] < len(index) or bad.any():
            raise DumpError(f"{self.path}: /{s.STATS} rows point outside the file's layers "
                            "or values (damaged file)")
        self.stat_columns, self.stats_index, self._stats_values = columns, index, values

    @property
    def has_stats(self) -> bool:
        """A statistics dump (``--store stats``): the reductions are in /stats."""
        return self._stats_values is not None

    def stats_row(self, index: int) -> dict[str, float]:
        """Row ``index`` of the stats table, by column name."""
        if self._stats_values is None:
            return {}
        with _reading(self.path):
            values = np.asarray(self._stats_values[index], dtype=np.float64)
        return dict(zip(self.stat_columns, values.tolist()))

    def stats_values(self) -> np.ndarray:
        """(rows of /stats/index, columns) float64: every row of the stats table."""
        if self._stats_values is None:
            return np.zeros((0, 0))
        with _reading(self.path):
            return np.asarray(self._stats_values[: len(self.stats_index)], dtype=np.float64)

    # -- validation helpers -----------------------------------------------------------------
    def _json_attr(self, name: str) -> dict:
        text = _attr_text(self.f, name)
        if name not in self.f.attrs:
            return {}
        try:
            value = json.loads(text) if text is not None else None
        except ValueError as exc:
            raise DumpError(f"{self.path}: {name} attribute is not valid JSON") from exc
        if not isinstance(value, dict):
            raise DumpError(f"{self.path}: {name} attribute is not a JSON object")
        return value

    def _dataset(self, name: str) -> h5py.Dataset:
        ds = self.f.get(name)
        if not isinstance(ds, h5py.Dataset) or ds.ndim != 1:
            raise DumpError(f"{self.path}: /{name} is not a one-dimensional data set")
        self._check_stored(ds)
        return ds

    def _check_stored(self, ds: h5py.Dataset) -> None:
        """Refuse a data set that declares more data than the file stores: HDF5 would return
        fill values for the missing part, so reading it would only allocate memory."""
        declared = ds.size * ds.dtype.itemsize
        if declared <= _STORAGE_SLACK:
            return
        stored = ds.id.get_storage_size()
        chunk = int(np.prod(ds.chunks)) * ds.dtype.itemsize if ds.chunks else 0
        if ds.id.get_create_plist().get_nfilters():
            stored *= _MAX_COMPRESSION
        if declared > stored + chunk + _STORAGE_SLACK:
            raise DumpError(
                f"{self.path}: {ds.name} declares shape {ds.shape} ({declared} bytes) but the "
                f"file stores {ds.id.get_storage_size()} bytes of it (damaged file)"
            )

    def _names(self, name: str) -> list[str]:
        ds = self._dataset(name)
        if h5py.check_string_dtype(ds.dtype) is None:  # never object references
            raise DumpError(f"{self.path}: /{name} does not hold strings")
        return [_text(x) for x in ds[()]]

    def _table(self, name: str, want: np.dtype) -> np.ndarray:
        """The whole table in the schema's dtype; fields must exist and hold plain numbers."""
        ds = self._dataset(name)
        have = ds.dtype
        missing = set(want.names) - set(have.names or ())
        if missing:
            raise DumpError(f"{self.path}: /{name} lacks fields {sorted(missing)}")
        for field in want.names:
            if have[field].kind not in _NUMBER_KINDS or have[field].shape != ():
                raise DumpError(
                    f"{self.path}: /{name} field {field!r} has type {have[field]}, not a number"
                )
        raw = ds[()]
        out = np.zeros(raw.shape[0], dtype=want)
        with np.errstate(all="ignore"):  # a damaged file may hold NaN or huge values here
            for field in want.names:
                out[field] = raw[field]
        return out

    def _index_length(self, name: str) -> int:
        """Length of an index data set (0 when absent); it must hold integers."""
        if name not in self.f:
            return 0
        ds = self._dataset(name)
        if ds.dtype.kind not in "iu":
            raise DumpError(f"{self.path}: /{name} does not hold integers")
        return ds.shape[0]

    def _without_cut_round(self, lengths: dict[str, int], probes: np.ndarray) -> np.ndarray:
        """A ``.partial`` file: the round being written when the process died is dropped
        whole, as if it had never begun (every finished round was flushed before it). HDF5
        writes its metadata in no set order before a flush, so a table may hold rows of that
        round, or rows whose length was written and whose values were not (zeros: round 0):
        each table is cut where its rows stop being finished rows in write order (a round or
        record number that goes down, a row that reads as damaged, a round with no /rounds
        row). Returns the /probes rows kept."""
        if len(self.rounds) and self._bad_rounds(lengths)[-1]:
            self.rounds = self.rounds[:-1]
        stored = self.stored_records
        finished = ((stored["batch"] >= 1) & (stored["ntok"] >= 1)
                    & np.isin(stored["round"], self.rounds["round"]))
        self.stored_records = stored[:_in_order(stored["round"], finished)]
        owner = probes["record"].astype(np.int64)
        ok = (owner < len(self.stored_records)) & (probes["batch"] >= 1)
        return probes[:_in_order(owner, ok)]

    def _bad_rounds(self, lengths: dict[str, int]) -> np.ndarray:
        """Rounds that point outside their index data sets."""
        r = self.rounds
        bad = np.zeros(len(r), dtype=bool)
        for off, n, name in (
            ("pos_off", "ntok", s.POSITIONS),
            ("tok_off", "tok_len", s.TOKEN_IDS),
            ("prow_off", "prow_len", s.PROBE_ROWS),
        ):
            start, count = r[off].astype(np.int64), r[n].astype(np.int64)
            bad |= (start < 0) | (count < 0) | (start > lengths[name] - count)
        return bad | (r["batch"] < 1) | (r["seq"] < 0)

    def _check_rounds(self, lengths: dict[str, int]) -> None:
        r = self.rounds
        bad = self._bad_rounds(lengths)
        if bad.any():
            raise DumpError(
                f"{self.path}: {int(bad.sum())} rounds point outside their data (damaged file)"
            )
        if len(r) and r["prow_len"].any():
            rows = self.f[s.PROBE_ROWS][()]
            for row in r[r["prow_len"] > 0]:
                mine = rows[int(row["prow_off"]) : int(row["prow_off"]) + int(row["prow_len"])]
                limit = int(row["batch"]) * int(row["ntok"])
                if mine.min() < 0 or mine.max() >= limit:
                    raise DumpError(
                        f"{self.path}: probe rows of round {int(row['round'])} are outside its "
                        f"{limit} rows (damaged file)"
                    )

    def _expand(self, stored: np.ndarray, grouped: np.ndarray, probes: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
        """The per-probe view of the records (see the class) and each row's group (-1: a
        record of its own). A group without /probes rows (cut off by a crash) shows none."""
        if not grouped.any():
            return stored, np.full(len(stored), -1, dtype=np.int64)
        owner = probes["record"].astype(np.int64)
        n = probes["batch"].astype(np.int64) * probes["ntok"].astype(np.int64)
        inside = (owner >= 0) & (owner < len(stored))
        at = np.where(inside, owner, 0)
        bad = (~inside | ~grouped[at] | (probes["row0"] < 0) | (probes["batch"] < 1)
               | (probes["ntok"] < 1) | (probes["row0"] > stored["nrows"][at] - n))
        if bad.any():
            raise DumpError(f"{self.path}: {int(bad.sum())} probe rows point outside their "
                            "records (damaged file)")
        order = np.argsort(owner, kind="stable")
        probes, owner, n = probes[order], owner[order], n[order]
        counts = np.bincount(owner, minlength=len(stored))
        sizes = np.where(grouped, counts, 1)
        starts = np.cumsum(sizes) - sizes
        out = np.zeros(int(sizes.sum()), dtype=s.RECORD_DTYPE)
        group = np.full(len(out), -1, dtype=np.int64)
        own = np.flatnonzero(~grouped)
        out[starts[own]] = stored[own]
        first = np.cumsum(counts) - counts  # each group's first row in the sorted probes
        at = starts[owner] + np.arange(len(owner)) - first[owner]
        parent = stored[owner]
        for name in ("round", "layer", "site", "data", "width"):
            out[name][at] = parent[name]
        for name in ("kind", "probe", "param", "seed", "pert_rms", "subset", "batch", "ntok"):
            out[name][at] = probes[name]
        out["row0"][at] = parent["row0"] + probes["row0"]
        out["nrows"][at] = n
        group[at] = owner
        return out, group

    def _check_records(self, r: np.ndarray, shapes: np.ndarray | None = None) -> None:
        """Records must point inside their data and have their round's shape (where
        ``shapes``: a KIND_PROBES record has the shapes of its probes). Records of a round
        without a /rounds row (cut off by a crash) are ignored by every reader."""
        if not len(r):
            return
        ids = r["data"]
        if ids.min() < 0 or ids.max() >= len(self._data):
            raise DumpError(f"{self.path}: records point to missing data sets")
        lengths = np.array([d.shape[0] for d, _ in self._data], dtype=np.int64)
        widths = np.array([d.shape[1] for d, _ in self._data], dtype=np.int64)
        row0, nrows = r["row0"], r["nrows"]
        batch, ntok = r["batch"].astype(np.int64), r["ntok"].astype(np.int64)
        bad = (
            (row0 < 0) | (nrows < 0) | (row0 > lengths[ids] - nrows)
            | (r["width"] != widths[ids]) | (batch < 1) | (ntok < 1) | (batch * ntok != nrows)
            | (r["layer"] < s.STACK_INPUT) | (r["layer"] >= len(self.layers))
            | (r["site"] < s.BLOCK_SITE) | (r["site"] >= len(self.sites))
        )
        if len(self.rounds):
            order = np.argsort(self.rounds["round"], kind="stable")
            keys = self.rounds["round"][order]
            at = np.clip(np.searchsorted(keys, r["round"]), 0, len(keys) - 1)
            known = keys[at] == r["round"]
            rnd = self.rounds[order[at]]
            subset = r["subset"] != 0
            want_batch = np.where(subset, 1, rnd["batch"])
            want_ntok = np.where(subset, rnd["prow_len"], rnd["ntok"])
            mismatch = (batch != want_batch) | (ntok != want_ntok)
            bad |= known & (mismatch if shapes is None else mismatch & shapes)
        if bad.any():
            raise DumpError(
                f"{self.path}: {int(bad.sum())} records point outside their data (damaged file)"
            )

    # -- queries ---------------------------------------------------------------------------
    def meta_int(self, key: str) -> int | None:
        """An integer metadata field (rank, pid...), None when absent or not a number."""
        try:
            value = int(self.meta.get(key))
        except (TypeError, ValueError, OverflowError):  # JSON allows Infinity
            return None
        return value if -(2**63) <= value < 2**63 else None  # the tables hold int64

    @property
    def n_samples(self) -> int:
        return int(len(np.unique(self.rounds["sample"]))) if len(self.rounds) else 0

    def select(
        self, layer: int | None = None, kind: int | None = s.KIND_CLEAN,
        site: int | None = s.BLOCK_SITE,
    ) -> np.ndarray:
        """Records matching a layer, kind and site (None = any), in file order."""
        r = self.records
        mask = np.ones(len(r), dtype=bool)
        if layer is not None:
            mask &= r["layer"] == layer
        if kind is not None:
            mask &= r["kind"] == kind
        if site is not None:
            mask &= r["site"] == site
        return r[mask]

    def read(self, record: np.void) -> np.ndarray:
        """Decode one record to a float array of shape (batch, ntok, width)."""
        row0, n = int(record["row0"]), int(record["nrows"])
        rows = self.read_rows(int(record["data"]), row0, row0 + n)
        return rows.reshape(int(record["batch"]), int(record["ntok"]), int(record["width"]))

    def read_rows(self, data: int, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of the data set with index ``data``, decoded, (rows, width):
        one read for the records of many layers of a round."""
        ds, dtype = self._data[int(data)]
        direct = self._direct(int(data))
        with _reading(self.path):
            stored = direct.read(start, stop) if direct is not None else None
            if stored is None:
                stored = ds[start:stop]
        return s.decode(stored, dtype)

    def _direct(self, data: int) -> ChunkRows | None:
        """The data set's rows read straight from the file (format/direct.py), when safe."""
        if not hasattr(self, "_chunk_rows"):
            self._chunk_rows: dict[int, ChunkRows | None] = {}
            self._fd = open_file(self.path)
        if data not in self._chunk_rows:
            ds = self._data[data][0]
            self._chunk_rows[data] = None if self._fd is None else ChunkRows.open(
                ds, self._fd[0], self._fd[1], int(self.f.userblock_size))
        return self._chunk_rows[data]

    def all_probe_rows(self) -> np.ndarray:
        """The whole /probe_rows array; a round's rows are ``[prow_off: prow_off + prow_len]``."""
        if s.PROBE_ROWS not in self.f:
            return np.zeros(0, np.int32)
        with _reading(self.path):
            return self.f[s.PROBE_ROWS][()]

    def all_positions(self) -> np.ndarray:
        """The whole /positions array; a round's are ``[pos_off: pos_off + ntok]``."""
        if s.POSITIONS not in self.f:
            return np.zeros(0, np.int32)
        with _reading(self.path):
            return self.f[s.POSITIONS][()]

    def all_token_ids(self) -> np.ndarray:
        """The whole /token_ids array; a round's are ``[tok_off: tok_off + tok_len]``."""
        if s.TOKEN_IDS not in self.f:
            return np.zeros(0, np.int64)
        with _reading(self.path):
            return self.f[s.TOKEN_IDS][()]

    def dtype_of(self, record: np.void) -> str:
        return self._data[int(record["data"])][1]

    @property
    def data_dtypes(self) -> list[str]:
        """Logical dtype of each data set, by the records' ``data`` index."""
        return [dtype for _, dtype in self._data]

    def token_ids(self, round_row: np.void) -> np.ndarray:
        return self._slice(s.TOKEN_IDS, round_row["tok_off"], round_row["tok_len"])

    def probe_rows(self, round_row: np.void) -> np.ndarray:
        """Rows of a round's clean records that its probe records (subset=1) hold."""
        return self._slice(s.PROBE_ROWS, round_row["prow_off"], round_row["prow_len"])

    def positions(self, round_row: np.void) -> np.ndarray:
        return self._slice(s.POSITIONS, round_row["pos_off"], round_row["ntok"])

    def _slice(self, name: str, off, n) -> np.ndarray:
        off, n = int(off), int(n)
        if n <= 0 or name not in self.f:
            return np.zeros(0, dtype=np.int64)
        with _reading(self.path):
            return self.f[name][off : off + n]

    def close(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd[0])
            self._fd = None
            self._chunk_rows = {}
        with _reading(self.path):
            self.f.close()

    def __enter__(self) -> DumpReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _attr_text(obj, name: str) -> str | None:
    """A string attribute, or None when it is missing or not a single string."""
    value = obj.attrs.get(name)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def _text(x) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)


def _in_order(keys: np.ndarray, ok: np.ndarray) -> int:
    """The length of the longest prefix of a table written in order whose ``keys`` never go
    down and whose rows are all ``ok``."""
    keys = keys.astype(np.int64)
    bad = ~ok
    bad[1:] |= keys[1:] < np.maximum.accumulate(keys)[:-1]
    return int(np.argmax(bad)) if bad.any() else len(keys)
