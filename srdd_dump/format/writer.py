"""Append-only writer of dump files (format/schema.py): numpy + h5py, on a background thread.

The capture side hands over finished rounds (numpy arrays already on the host); one thread does
all HDF5 I/O, so the user's device never waits on the disk, and each round costs one write per
dataset plus one flush.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import h5py
import numpy as np

from . import schema as s


@dataclass
class Tensor:
    """One captured tensor of shape (batch, ntok, width) in its storage dtype."""

    layer: int
    array: np.ndarray  # storage dtype, shape (batch, ntok, width)
    dtype: str  # logical dtype name, key of schema.STORAGE_DTYPES
    kind: int = s.KIND_CLEAN
    site: int = s.BLOCK_SITE
    probe: int = 0
    param: float = 0.0
    seed: int = 0
    pert_rms: float = 0.0
    subset: bool = False  # rows are the round's probe_rows, stored as batch 1


@dataclass
class StatRow:
    """One (layer, site)'s reductions of a round (``--store stats``), in the file's columns."""

    layer: int
    site: int
    dtype: int  # index into schema.DTYPE_CODES
    values: np.ndarray  # float64, one value per column (NaN: not measured)


@dataclass
class _Unit:
    """One record of a round as the writer lays it out: a tensor of its own, or (schema 5)
    the probe outputs of one site grouped into a KIND_PROBES record."""

    name: str  # its /data set
    dtype: str
    width: int
    record: Tensor  # the tensor (a group: its first probe, for layer and site)
    arrays: list[np.ndarray]
    probes: list[Tensor] = field(default_factory=list)  # a group's probes, in order
    row0: int = 0

    @property
    def rows(self) -> int:
        return sum(a.size // max(1, self.width) for a in self.arrays)


@dataclass
class Round:
    sample: int
    step: int
    batch: int
    seq: int
    positions: np.ndarray  # kept token positions (int)
    token_ids: np.ndarray | None = None  # (batch, seq) input ids, when visible
    probe_rows: np.ndarray | None = None  # rows of the clean records kept for probe records
    time: float = field(default_factory=time.time)
    tensors: list[Tensor] = field(default_factory=list)
    stats: list[StatRow] = field(default_factory=list)


def tokens_hash(token_ids: np.ndarray | None) -> int:
    if token_ids is None or token_ids.size == 0:
        return 0
    import hashlib

    digest = hashlib.blake2b(np.ascontiguousarray(token_ids, dtype="<i8").tobytes(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


# Kept free after every round: the metadata a round adds and what closing the file writes.
ROOM_RESERVE = 1 << 20
_MB = 1 << 20


class NoRoom(OSError):
    """The next round would not fit under the file-size limit or in the free disk space."""


def describe_error(exc: BaseException) -> str:
    """One line for an error; HDF5's own messages span lines and bury the errno."""
    text = " ".join(str(exc).split())
    found = re.search(r"errno = (\d+), error message = '([^']*)'", text)
    if found:
        return f"{found.group(2)} (errno {found.group(1)})"
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, NoRoom) else text


def _file_size_limit() -> int | None:
    try:
        import resource
    except ImportError:  # not on Unix
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


JOIN_BYTES = 4 << 20  # see _H5File._append_joined


def _runs(arrays: list[np.ndarray], limit: int) -> Iterator[list[np.ndarray]]:
    """Consecutive arrays in runs of at most ``limit`` bytes (an array over it alone)."""
    run: list[np.ndarray] = []
    size = 0
    for a in arrays:
        if run and size + a.nbytes > limit:
            yield run
            run, size = [], 0
        run.append(a)
        size += a.nbytes
    if run:
        yield run


def _growth(ds: h5py.Dataset | None, rows: int, chunk_rows: int, row_bytes: int) -> int:
    """Bytes the file grows by when ``rows`` rows are appended to a chunked data set."""
    before = ds.shape[0] if ds is not None else 0
    chunk_rows = ds.chunks[0] if ds is not None else chunk_rows
    new_chunks = -(-(before + rows) // chunk_rows) - (-(-before // chunk_rows))
    return new_chunks * chunk_rows * row_bytes


def _append(ds: h5py.Dataset, rows: np.ndarray) -> int:
    start = ds.shape[0]
    ds.resize(start + rows.shape[0], axis=0)
    ds[start:] = rows
    return start


class _H5File:
    """Synchronous part: owns the h5py handle."""

    def __init__(self, partial_path: str, meta: dict, layers: list[str], sites: list[str],
                 stat_columns: list[str] | None = None, version: int = s.SCHEMA_VERSION):
        self.path = partial_path
        self._close_tried = False
        # version 4 and older: one record per probe output (written for the tests that read
        # old files); 5: a site's probe outputs of a round in one KIND_PROBES record
        self.version = version
        self.grouped = version >= 5
        self._rows = np.empty(0, np.uint8)  # a round's rows of one data set, reused (below)
        # data sets by path, opened once: h5py's lookup and dtype cost ~0.1 ms each, 40 per
        # round (a third of the writer's time on a decode step's small round)
        self._open: dict[str, h5py.Dataset | None] = {}
        self._sizes: dict[str, int] = {}  # bytes per row of the top-level data sets
        self._check_room(ROOM_RESERVE, 0)
        self.f = h5py.File(partial_path, "w")
        try:
            self._fd = self.f.id.get_vfd_handle()  # read once: see detach
            self._create(meta, layers, sites)
            if stat_columns:
                self._create_stats(stat_columns)
        except Exception:
            self.abandon()
            raise

    def _create(self, meta: dict, layers: list[str], sites: list[str]) -> None:
        f = self.f
        f.attrs[s.ATTR_FORMAT] = s.FORMAT_NAME
        f.attrs[s.ATTR_VERSION] = self.version
        f.attrs[s.ATTR_META] = json.dumps(meta, default=str)
        f.attrs[s.ATTR_COMPLETE] = 0
        for name, names in ((s.LAYERS, layers), (s.SITES, sites)):
            f.create_dataset(name, data=np.array(names, dtype=object), dtype=h5py.string_dtype())
        for name, dtype, chunk in (
            (s.ROUNDS, s.ROUND_DTYPE, 256),
            (s.RECORDS, s.RECORD_DTYPE, 1024),
            (s.TOKEN_IDS, np.dtype("<i8"), 8192),
            (s.POSITIONS, np.dtype("<i4"), 8192),
            (s.PROBE_ROWS, np.dtype("<i4"), 8192),
            *([(s.PROBES, s.PROBE_DTYPE, 1024)] if self.grouped else []),
        ):
            f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(chunk,))
        f.create_group(s.DATA)
        self.data_index: dict[str, int] = {}
        self.n_rounds = 0
        f.flush()

    def _create_stats(self, columns: list[str]) -> None:
        self.f.create_dataset(s.STATS_INDEX, shape=(0,), maxshape=(None,),
                              dtype=s.STATS_INDEX_DTYPE, chunks=(1024,))
        values = self.f.create_dataset(s.STATS_VALUES, shape=(0, len(columns)),
                                       maxshape=(None, len(columns)), dtype="<f8",
                                       chunks=(max(1, 8192 // len(columns)), len(columns)))
        values.attrs[s.ATTR_COLUMNS] = json.dumps(columns)
        self.f.flush()

    def _get(self, path: str) -> h5py.Dataset | None:
        """The data set at ``path`` (None: the file has none there), opened once."""
        if path not in self._open:
            self._open[path] = self.f.get(path)
        return self._open[path]

    def _dataset(self, name: str, dtype: str, width: int) -> h5py.Dataset:
        if name not in self.data_index:
            group = self.f[s.DATA]
            storage = s.STORAGE_DTYPES[dtype]
            ds = group.create_dataset(
                name,
                shape=(0, width),
                maxshape=(None, width),
                dtype=storage,
                chunks=(s.chunk_rows(width, storage.itemsize), width),
            )
            ds.attrs[s.ATTR_DTYPE] = dtype
            # Ids follow the sorted order of names, as the reader sees them.
            names = sorted(list(group.keys()))
            old, self.data_index = self.data_index, {n: i for i, n in enumerate(names)}
            if any(self.data_index[n] != i for n, i in old.items()):
                self._renumber_records(old)
        return self._get(f"{s.DATA}/{name}")

    def _renumber_records(self, old: dict[str, int]) -> None:
        """A data set whose name sorts before existing ones appeared after the first round
        (a probe kind first seen later): the records written so far get the new ids."""
        records = self._get(s.RECORDS)
        if not records.shape[0]:
            return
        new_id = np.zeros(max(old.values()) + 1, dtype=np.int64)
        for name, i in old.items():
            new_id[i] = self.data_index[name]
        table = records[:]
        table["data"] = new_id[table["data"]]
        records[:] = table

    def _units(self, tensors: list[Tensor]) -> list[_Unit]:
        """The records of a round's tensors, in order: each clean, mask or route tensor is a
        record of its own; from schema 5 on, the probe outputs of one (layer, site, logical
        dtype, width) are one KIND_PROBES record at the place of its first."""
        units: list[_Unit] = []
        groups: dict[tuple, _Unit] = {}
        for t in tensors:
            width = t.array.shape[-1]
            if not self.grouped or t.kind in s.OWN_RECORD_KINDS:
                units.append(_Unit(s.data_name(t.kind, t.dtype, width), t.dtype, width, t,
                                   [t.array]))
                continue
            key = (t.layer, t.site, t.dtype, width)
            unit = groups.get(key)
            if unit is None:
                unit = groups[key] = _Unit(s.data_name(s.KIND_PROBES, t.dtype, width),
                                           t.dtype, width, t, [], [])
                units.append(unit)
            unit.arrays.append(t.array)
            unit.probes.append(t)
        return units

    def room_needed(self, r: Round) -> int:
        """Upper bound of the bytes writing ``r`` adds to the file, with ROOM_RESERVE."""
        need = ROOM_RESERVE
        by_name: dict[str, list[int]] = {}
        units = self._units(r.tensors)
        for unit in units:
            name, width = unit.name, unit.width
            itemsize = s.STORAGE_DTYPES[unit.dtype].itemsize
            entry = by_name.setdefault(name, [0, width * itemsize, s.chunk_rows(width, itemsize)])
            entry[0] += unit.rows
        for name, (rows, row_bytes, chunk) in by_name.items():
            ds = self._get(f"{s.DATA}/{name}") if name in self.data_index else None
            need += _growth(ds, rows, chunk, row_bytes)
        tok = 0 if r.token_ids is None else int(np.size(r.token_ids))
        prows = 0 if r.probe_rows is None else len(r.probe_rows)
        for name, rows in (
            (s.POSITIONS, len(r.positions)), (s.TOKEN_IDS, tok), (s.PROBE_ROWS, prows),
            (s.RECORDS, len(units)), (s.PROBES, sum(len(u.probes) for u in units)),
            (s.ROUNDS, 1),
            (s.STATS_INDEX, len(r.stats)), (s.STATS_VALUES, len(r.stats)),
        ):
            ds = self._get(name)
            if ds is not None and rows:
                need += _growth(ds, rows, ds.chunks[0], self._row_bytes(name, ds))
        return need

    def _row_bytes(self, name: str, ds: h5py.Dataset) -> int:
        size = self._sizes.get(name)
        if size is None:
            size = self._sizes[name] = ds.dtype.itemsize * (ds.shape[1] if ds.ndim == 2 else 1)
        return size

    def _check_room(self, need: int, size: int, what: str = "the next round") -> None:
        """Raise NoRoom when ``need`` more bytes would pass the file-size limit or fill the
        disk: a write that fails half-way leaves an HDF5 file that cannot be closed safely."""
        limit = _file_size_limit()
        if limit is not None and size + need > limit:
            raise NoRoom(
                f"no room for {what}: the file-size limit (RLIMIT_FSIZE, "
                f"{limit / _MB:.2f} MB) allows {max(0, limit - size) / _MB:.2f} MB more, it "
                f"needs {need / _MB:.2f} MB"
            )
        folder = os.path.dirname(os.path.abspath(self.path))
        free = shutil.disk_usage(folder).free
        if need > free:
            raise NoRoom(
                f"no room for {what}: {free / _MB:.2f} MB free on the file system of "
                f"{folder}, it needs {need / _MB:.2f} MB"
            )

    def write_round(self, r: Round) -> None:
        f = self.f
        self._check_room(self.room_needed(r), f.id.get_filesize())
        pos_off = _append(self._get(s.POSITIONS), np.asarray(r.positions, dtype="<i4"))
        tok = (
            np.asarray(r.token_ids, dtype="<i8").reshape(-1)
            if r.token_ids is not None
            else np.zeros(0, "<i8")
        )
        tok_ds, prow_ds = self._get(s.TOKEN_IDS), self._get(s.PROBE_ROWS)
        tok_off = _append(tok_ds, tok) if tok.size else tok_ds.shape[0]
        prows = np.zeros(0, "<i4") if r.probe_rows is None else np.asarray(r.probe_rows, "<i4")
        prow_off = _append(prow_ds, prows) if prows.size else prow_ds.shape[0]

        units = self._units(r.tensors)
        by_name: dict[str, list[_Unit]] = {}
        for unit in units:
            by_name.setdefault(unit.name, []).append(unit)
        for name, group in by_name.items():
            width = group[0].width
            ds = self._dataset(name, group[0].dtype, width)
            start = self._append_joined(ds, [a.reshape(-1, width) for u in group
                                             for a in u.arrays])
            for unit in group:
                unit.row0 = start
                start += unit.rows
        units = [u for group in by_name.values() for u in group]  # records in data order

        records = np.zeros(len(units), dtype=s.RECORD_DTYPE)
        first = self._get(s.RECORDS).shape[0]
        probes = []
        for i, unit in enumerate(units):
            t = unit.record
            if unit.probes:  # a KIND_PROBES record: batch 1, every row of its probes
                records[i] = (self.n_rounds, t.layer, t.site, s.KIND_PROBES, len(unit.probes),
                              0.0, 0, 0.0, 0, self.data_index[unit.name], unit.row0,
                              unit.rows, 1, unit.rows, unit.width)
                offset = 0
                for p in unit.probes:
                    b, n, _ = p.array.shape
                    probes.append((first + i, p.kind, p.probe, p.param, p.seed, p.pert_rms,
                                   int(p.subset), offset, b, n))
                    offset += b * n
                continue
            b, n, w = t.array.shape
            records[i] = (
                self.n_rounds, t.layer, t.site, t.kind, t.probe, t.param, t.seed, t.pert_rms,
                int(t.subset), self.data_index[unit.name], unit.row0, b * n, b, n, w,
            )
        _append(self._get(s.RECORDS), records)
        if probes:  # after the records they point to
            _append(self._get(s.PROBES), np.array(probes, dtype=s.PROBE_DTYPE))
        if r.stats:
            index = np.zeros(len(r.stats), dtype=s.STATS_INDEX_DTYPE)
            index["round"] = self.n_rounds
            index["layer"] = [st.layer for st in r.stats]
            index["site"] = [st.site for st in r.stats]
            index["dtype"] = [st.dtype for st in r.stats]
            _append(self._get(s.STATS_VALUES), np.stack([st.values for st in r.stats]))
            _append(self._get(s.STATS_INDEX), index)
        # the round's data, records and index rows reach the file before its /rounds row: a
        # crash leaves a round whole or without that row (format/reader.py drops it then)
        f.flush()
        row = np.array(
            [(
                self.n_rounds, r.sample, r.step, r.batch, r.seq, len(r.positions), pos_off,
                tok_off, tok.size, tokens_hash(r.token_ids), prow_off, prows.size, r.time,
            )],
            dtype=s.ROUND_DTYPE,
        )
        _append(self._get(s.ROUNDS), row)
        self.n_rounds += 1
        f.flush()

    def _append_joined(self, ds: h5py.Dataset, arrays: list[np.ndarray]) -> int:
        """Append the arrays one after the other; returns the first row. They reach h5py
        in runs of up to JOIN_BYTES joined in one reused buffer: a fresh buffer of a probed
        round's 130 MB has its pages faulted in (0.2 s of this machine's CPU), one h5py write
        per array costs more than the copy."""
        start = row = ds.shape[0]
        ds.resize(start + sum(a.shape[0] for a in arrays), axis=0)
        try:
            for run in _runs(arrays, JOIN_BYTES):
                joined = run[0] if len(run) == 1 else self._joined(run)
                ds[row:row + joined.shape[0]] = joined
                row += joined.shape[0]
        except BaseException:
            # no rows declared that the file does not hold: the earlier rounds stay readable
            with contextlib.suppress(Exception):  # the first error is the one to report
                ds.resize(start, axis=0)
            raise
        return start

    def _joined(self, arrays: list[np.ndarray]) -> np.ndarray:
        n, width, dtype = sum(a.shape[0] for a in arrays), arrays[0].shape[1], arrays[0].dtype
        nbytes = n * width * dtype.itemsize
        if self._rows.size < nbytes:
            self._rows = np.empty(nbytes, np.uint8)
        out = self._rows[:nbytes].view(dtype).reshape(n, width)
        return np.concatenate(arrays, axis=0, out=out)

    def close(self, status: dict, complete: bool) -> None:
        """Write the status and close. Everything is flushed before ``close``: if the flush
        fails the caller can still ``abandon`` the file, which a failed close rules out.
        Raises NoRoom, having written nothing, when the status may not fit (the disk filled
        up from elsewhere): the file is then as the last round's flush left it."""
        text = json.dumps(status, default=str)
        self._check_room(len(text) + ROOM_RESERVE, self.f.id.get_filesize(),
                         "the file's closing status")
        self.f.attrs[s.ATTR_STATUS] = text
        self.f.attrs[s.ATTR_COMPLETE] = int(complete)
        self.f.flush()
        self._close_tried = True
        self.f.close()

    def flushes(self) -> bool:
        """Whether the file can still be flushed after a failed write (then it is intact)."""
        try:
            self.f.flush()
            return True
        except Exception:
            return False

    def detach(self) -> None:
        """Point the file's descriptor at /dev/null, after a write failed for good.

        HDF5 then still holds dirty data for the file, and every later release of a handle
        (a data set object being freed, the file's close, the library's own at process exit)
        tries to write it, fails, and the second failure crashes the process (use after free
        in HDF5 2.0). Detached, those writes succeed into /dev/null and what is on disk stays
        as the last successful flush left it. Call it before any handle of the file is freed.
        """
        try:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, self._fd)  # no h5py call: in a forked child its lock may be held
            os.close(null)
        except Exception:
            pass

    def abandon(self) -> None:
        """Close a file whose writes failed, without writing anything more to it."""
        self.detach()
        if self._close_tried:
            return  # a second close of the same file is the crash itself
        try:
            self.f.close()
        except Exception:
            pass


class DumpWriter:
    """Writes one dump file as ``path + '.partial'`` and renames it to ``path`` on close.

    ``submit`` never raises: an I/O failure is kept in ``error`` and later rounds are dropped.
    Before each round the writer checks that it fits under the file-size limit and in the free
    disk space; if not, it stops there and the file is finalised with every round before it.
    A round's write that fails anyway (the disk filled up from elsewhere) makes the file
    abandoned: closed without further writes and renamed ``*.h5.broken``; the process stays
    safe. When the closing status would not fit, nothing is written and the file stays
    ``.partial``: every round was flushed before it.
    """

    def __init__(
        self, path: str, meta: dict, layers: list[str], sites: list[str] | None = None,
        max_pending: int = 4, stat_columns: list[str] | None = None,
        version: int = s.SCHEMA_VERSION,
    ):
        """``max_pending``: rounds queued for the writing thread; 0: no thread, ``submit``
        writes the round before it returns (one round in memory at a time). ``version``: an
        older schema's layout (4: one record per probe output), for tests of old files."""
        self.path = path
        self.partial_path = path + s.PARTIAL_SUFFIX
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.error: str | None = None
        self.rounds_written = 0
        self._broken = False  # a write failed: the HDF5 file must be abandoned, not closed
        self._file = _H5File(self.partial_path, meta, layers, sites or [], stat_columns,
                             version)
        self._queue: queue.Queue = queue.Queue(maxsize=max(max_pending, 1))
        self._thread: threading.Thread | None = None
        if max_pending > 0:
            self._thread = threading.Thread(target=self._run, name="srdd-dump-writer",
                                            daemon=True)
            self._thread.start()
        self._closed = False

    def forget_after_fork(self) -> None:
        """In a forked child: the file and the writer thread are the parent's. This process's
        descriptor of the file is pointed at /dev/null, so nothing it frees or closes (the
        HDF5 library's own close at exit included) writes into the parent's file; keep the
        writer referenced, never closed."""
        self._closed = True
        self._file.detach()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._write(item)

    def _write(self, item: Round) -> None:
        if self.error is not None:
            return
        try:
            self._file.write_round(item)
            self.rounds_written += 1
        except NoRoom as exc:  # nothing was written: the file is intact
            self.error = describe_error(exc)
        except Exception as exc:  # disk full, RLIMIT_FSIZE... from elsewhere
            self.error = describe_error(exc)
            if not self._file.flushes():  # still inside except: the data sets are alive
                self._file.detach()
                self._broken = True

    def submit(self, r: Round) -> None:
        if self.error is None and not self._closed:
            if self._thread is None:
                self._write(r)
            else:
                self._queue.put(r)

    def _set_aside(self) -> str:
        broken = self.path + s.BROKEN_SUFFIX
        try:
            os.replace(self.partial_path, broken)
        except OSError:
            return self.partial_path
        return broken

    def close(self, status: dict | None = None) -> str:
        """Finish pending writes, mark the file complete and rename it. Returns the final path:
        ``path``, ``path + s.BROKEN_SUFFIX`` when a write failed half-way, the ``.partial``
        path when the status could not be written (``error`` says why)."""
        if self._closed:
            for name in (self.path, self.path + s.BROKEN_SUFFIX):
                if os.path.exists(name):
                    return name
            return self.partial_path
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        status = dict(status or {})
        status.setdefault("rounds", self.rounds_written)
        if self.error:
            status["write_error"] = self.error
        if not self._broken:
            try:
                self._file.close(status, complete=self.error is None and not status.get("error"))
            except NoRoom as exc:  # nothing written: the file is what a crash between rounds
                # leaves, every round flushed, a .partial file the reader takes as cut short
                self.error = self.error or describe_error(exc)
                self._file.abandon()
                return self.partial_path
            except Exception as exc:  # the status write failed half-way: HDF5's metadata
                self.error = self.error or describe_error(exc)  # may be half-rewritten
                self._broken = True
        if self._broken:
            self._file.abandon()
            return self._set_aside()
        try:
            os.replace(self.partial_path, self.path)
        except OSError as exc:  # the finished file stays usable under its .partial name
            self.error = self.error or f"cannot rename it: {describe_error(exc)}"
            return self.partial_path
        return self.path
