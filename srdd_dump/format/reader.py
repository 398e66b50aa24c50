"""Reader of schema-v1 dump files. numpy + h5py only (no torch, no pickle)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import h5py
import numpy as np

from ..errors import first_line
from . import schema as s


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
    arrays), ``complete`` (False for a file cut short by a crash), ``status`` (dict).
    """

    def __init__(self, path: str):
        self.path = path
        try:
            self.f = h5py.File(path, "r")
        except (OSError, ValueError) as exc:
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
        if f.attrs.get(s.ATTR_FORMAT) != s.FORMAT_NAME:
            raise DumpError(f"{path}: not an srdd-dump file (no format attribute)")
        version = f.attrs.get(s.ATTR_VERSION)
        if not isinstance(version, (int, np.integer)):
            raise DumpError(f"{path}: schema_version attribute missing or not an integer")
        if version > s.SCHEMA_VERSION:
            raise DumpError(
                f"{path}: schema version {version} is newer than this srdd-compare reads "
                f"({s.SCHEMA_VERSION}); upgrade srdd-dump"
            )
        for name in (s.LAYERS, s.ROUNDS, s.RECORDS, s.DATA):
            if name not in f:
                raise DumpError(f"{path}: missing /{name}")
        try:
            self.meta = json.loads(f.attrs.get(s.ATTR_META, "{}"))
            self.status = json.loads(f.attrs.get(s.ATTR_STATUS, "{}"))
        except (TypeError, ValueError) as exc:
            raise DumpError(f"{path}: metadata is not valid JSON") from exc
        if not isinstance(self.meta, dict) or not isinstance(self.status, dict):
            raise DumpError(f"{path}: metadata is not a JSON object")
        self.complete = bool(f.attrs.get(s.ATTR_COMPLETE, 0)) and not path.endswith(
            s.PARTIAL_SUFFIX
        )
        self.layers = [_text(x) for x in f[s.LAYERS][()]]
        self.sites = [_text(x) for x in f[s.SITES][()]] if s.SITES in f else []
        rounds = f[s.ROUNDS]
        records = f[s.RECORDS]
        for ds, want in ((rounds, s.ROUND_DTYPE), (records, s.RECORD_DTYPE)):
            missing = set(want.names) - set(ds.dtype.names or ())
            if missing:
                raise DumpError(f"{path}: /{ds.name.lstrip('/')} lacks fields {sorted(missing)}")
        self.rounds = rounds[()]
        self.records = records[()]
        self.data_names = sorted(f[s.DATA].keys())
        self._data = []
        for name in self.data_names:
            ds = f[s.DATA][name]
            dtype = _text(ds.attrs.get(s.ATTR_DTYPE, ""))
            if ds.ndim != 2 or dtype not in s.STORAGE_DTYPES or ds.dtype != s.STORAGE_DTYPES[dtype]:
                raise DumpError(f"{path}: /data/{name} has an unexpected shape or dtype")
            self._data.append((ds, dtype))
        # A round without records (cut off mid-write) is ignored; records must point inside data.
        if len(self.records):
            r = self.records
            ids = r["data"]
            if ids.min() < 0 or ids.max() >= len(self._data):
                raise DumpError(f"{path}: records point to missing data sets")
            lengths = np.array([d.shape[0] for d, _ in self._data])
            widths = np.array([d.shape[1] for d, _ in self._data])
            bad = (
                (r["row0"] < 0)
                | (r["nrows"] < 0)
                | (r["row0"] + r["nrows"] > lengths[ids])
                | (r["width"] != widths[ids])
                | (r["batch"].astype(np.int64) * r["ntok"] != r["nrows"])
            )
            if bad.any():
                raise DumpError(
                    f"{path}: {int(bad.sum())} records point outside their data (damaged file)"
                )

    # -- queries ---------------------------------------------------------------------------
    def meta_int(self, key: str) -> int | None:
        """An integer metadata field (rank, pid...), None when absent or not a number."""
        try:
            return int(self.meta.get(key))
        except (TypeError, ValueError):
            return None

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
        ds, dtype = self._data[int(record["data"])]
        row0, n = int(record["row0"]), int(record["nrows"])
        rows = s.decode(ds[row0 : row0 + n], dtype)
        return rows.reshape(int(record["batch"]), int(record["ntok"]), int(record["width"]))

    def dtype_of(self, record: np.void) -> str:
        return self._data[int(record["data"])][1]

    def iter_layer(
        self, layer: int, kind: int = s.KIND_CLEAN
    ) -> Iterator[tuple[np.void, np.ndarray]]:
        for rec in self.select(layer, kind):
            yield rec, self.read(rec)

    def token_ids(self, round_row: np.void) -> np.ndarray:
        off, n = int(round_row["tok_off"]), int(round_row["tok_len"])
        return self.f[s.TOKEN_IDS][off : off + n]

    def probe_rows(self, round_row: np.void) -> np.ndarray:
        """Rows of a round's clean records that its probe records (subset=1) hold."""
        off, n = int(round_row["prow_off"]), int(round_row["prow_len"])
        return self.f[s.PROBE_ROWS][off : off + n]

    def positions(self, round_row: np.void) -> np.ndarray:
        off, n = int(round_row["pos_off"]), int(round_row["ntok"])
        return self.f[s.POSITIONS][off : off + n]

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> DumpReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _text(x) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
