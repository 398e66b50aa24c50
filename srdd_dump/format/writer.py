"""Append-only writer of schema-v1 dump files. numpy + h5py only; runs on a background thread.

The capture side hands over finished rounds (numpy arrays already on the host); one thread does
all HDF5 I/O, so the user's device never waits on the disk, and each round costs one write per
dataset plus one flush.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
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


def tokens_hash(token_ids: np.ndarray | None) -> int:
    if token_ids is None or token_ids.size == 0:
        return 0
    import hashlib

    digest = hashlib.blake2b(np.ascontiguousarray(token_ids, dtype="<i8").tobytes(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def _append(ds: h5py.Dataset, rows: np.ndarray) -> int:
    start = ds.shape[0]
    ds.resize(start + rows.shape[0], axis=0)
    ds[start:] = rows
    return start


class _H5File:
    """Synchronous part: owns the h5py handle."""

    def __init__(self, partial_path: str, meta: dict, layers: list[str], sites: list[str]):
        self.f = h5py.File(partial_path, "w")
        f = self.f
        f.attrs[s.ATTR_FORMAT] = s.FORMAT_NAME
        f.attrs[s.ATTR_VERSION] = s.SCHEMA_VERSION
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
        ):
            f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(chunk,))
        f.create_group(s.DATA)
        self.data_index: dict[str, int] = {}
        self.n_rounds = 0
        f.flush()

    def _dataset(self, name: str, dtype: str, width: int) -> h5py.Dataset:
        group = self.f[s.DATA]
        if name not in group:
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
            self.data_index = {n: i for i, n in enumerate(names)}
        return group[name]

    def write_round(self, r: Round) -> None:
        f = self.f
        pos_off = _append(f[s.POSITIONS], np.asarray(r.positions, dtype="<i4"))
        tok = (
            np.asarray(r.token_ids, dtype="<i8").reshape(-1)
            if r.token_ids is not None
            else np.zeros(0, "<i8")
        )
        tok_off = _append(f[s.TOKEN_IDS], tok) if tok.size else f[s.TOKEN_IDS].shape[0]
        prows = np.zeros(0, "<i4") if r.probe_rows is None else np.asarray(r.probe_rows, "<i4")
        prow_off = _append(f[s.PROBE_ROWS], prows) if prows.size else f[s.PROBE_ROWS].shape[0]

        by_name: dict[str, list[Tensor]] = {}
        for t in r.tensors:
            by_name.setdefault(s.data_name(t.kind, t.dtype, t.array.shape[-1]), []).append(t)
        placed: list[tuple[Tensor, str, int]] = []
        for name, ts in by_name.items():
            width = ts[0].array.shape[-1]
            ds = self._dataset(name, ts[0].dtype, width)
            rows = np.concatenate([t.array.reshape(-1, width) for t in ts], axis=0)
            start = _append(ds, rows)
            for t in ts:
                placed.append((t, name, start))
                start += t.array.shape[0] * t.array.shape[1]

        records = np.zeros(len(placed), dtype=s.RECORD_DTYPE)
        for i, (t, name, row0) in enumerate(placed):
            b, n, w = t.array.shape
            records[i] = (
                self.n_rounds, t.layer, t.site, t.kind, t.probe, t.param, t.seed, t.pert_rms,
                int(t.subset), self.data_index[name], row0, b * n, b, n, w,
            )
        _append(f[s.RECORDS], records)
        row = np.array(
            [(
                self.n_rounds, r.sample, r.step, r.batch, r.seq, len(r.positions), pos_off,
                tok_off, tok.size, tokens_hash(r.token_ids), prow_off, prows.size, r.time,
            )],
            dtype=s.ROUND_DTYPE,
        )
        _append(f[s.ROUNDS], row)
        self.n_rounds += 1
        f.flush()

    def close(self, status: dict, complete: bool) -> None:
        self.f.attrs[s.ATTR_STATUS] = json.dumps(status, default=str)
        self.f.attrs[s.ATTR_COMPLETE] = int(complete)
        self.f.close()


class DumpWriter:
    """Writes one dump file as ``path + '.partial'`` and renames it to ``path`` on close.

    ``submit`` never raises: an I/O failure (disk full, file-size limit) is kept in ``error``,
    later rounds are dropped, and whatever was flushed before stays readable.
    """

    def __init__(
        self, path: str, meta: dict, layers: list[str], sites: list[str] | None = None,
        max_pending: int = 4,
    ):
        self.path = path
        self.partial_path = path + s.PARTIAL_SUFFIX
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.error: str | None = None
        self.rounds_written = 0
        self._file = _H5File(self.partial_path, meta, layers, sites or [])
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._run, name="srdd-dump-writer", daemon=True)
        self._thread.start()
        self._closed = False

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.error is not None:
                continue
            try:
                self._file.write_round(item)
                self.rounds_written += 1
            except Exception as exc:  # disk full, RLIMIT_FSIZE, ... keep what is flushed
                self.error = f"{type(exc).__name__}: {exc}"

    def submit(self, r: Round) -> None:
        if self.error is None and not self._closed:
            self._queue.put(r)

    def close(self, status: dict | None = None) -> str:
        """Finish pending writes, mark the file complete and rename it. Returns the final path."""
        if self._closed:
            return self.path if os.path.exists(self.path) else self.partial_path
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        status = dict(status or {})
        status.setdefault("rounds", self.rounds_written)
        if self.error:
            status["write_error"] = self.error
        try:
            self._file.close(status, complete=self.error is None and not status.get("error"))
        except Exception as exc:
            self.error = self.error or f"{type(exc).__name__}: {exc}"
            try:
                self._file.f.close()
            except Exception:
                pass
            return self.partial_path
        os.replace(self.partial_path, self.path)
        return self.path
