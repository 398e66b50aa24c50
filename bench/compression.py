"""HDF5 compression of the full store (issue 17): the filters h5py ships (gzip, lzf, with and
without shuffle) side by side with no filter, for size, write speed and read speed.

    python bench/compression.py --dump FILE.h5 [--workdir DIR] [--repeats 3]
                                [--out bench/results/compression.csv]

FILE.h5: a full-store SmolLM2 dump (``srdd-dump --exec "python fixtures/infer_smollm2.py
--prompts 7" --store full``). Each variant is the same file with every /data set rewritten
with the filter, chunked as the writer chunks it (512 KiB of whole rows) and appended in pieces
of one round's rows, as the writer appends them. Write: seconds to write the /data sets
(h5py, into the page cache, flush and close included). Read: seconds of the whole
``srdd-compare FILE -o report.csv`` (start-up included; default options) and of reading every
/data set with h5py. Medians of --repeats, page cache warm.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _models import write_rows  # noqa: E402

VARIANTS = {
    "none": {},
    "lzf": {"compression": "lzf"},
    "shuffle+lzf": {"compression": "lzf", "shuffle": True},
    "gzip-1": {"compression": "gzip", "compression_opts": 1},
    "shuffle+gzip-1": {"compression": "gzip", "compression_opts": 1, "shuffle": True},
    "gzip-4": {"compression": "gzip", "compression_opts": 4},
    "shuffle+gzip-4": {"compression": "gzip", "compression_opts": 4, "shuffle": True},
}


def rewrite(src: str, dst: str, filters: dict) -> float:
    """``src`` copied to ``dst`` with every /data set written with ``filters``; the seconds
    the /data writes took."""
    seconds = 0.0
    with h5py.File(src, "r") as fin, h5py.File(dst, "w") as fout:
        for key, value in fin.attrs.items():
            fout.attrs[key] = value
        for name in fin:
            if name != "data":
                fin.copy(name, fout)
        group = fout.create_group("data")
        records = fin["records"][:]
        for index, name in enumerate(sorted(fin["data"])):
            ds = fin["data"][name]
            data = ds[()]
            mine = records[records["data"] == index]
            # the writer appends one round's rows at a time
            cuts = np.unique(np.concatenate([[0], [data.shape[0]], _round_starts(mine)]))
            start = time.perf_counter()
            out = group.create_dataset(name, shape=(0, ds.shape[1]), maxshape=(None, ds.shape[1]),
                                       dtype=ds.dtype, chunks=ds.chunks, **filters)
            for a, b in zip(cuts[:-1], cuts[1:]):
                out.resize(b, axis=0)
                out[a:b] = data[a:b]
            fout.flush()
            seconds += time.perf_counter() - start
            for key, value in ds.attrs.items():
                out.attrs[key] = value
        start = time.perf_counter()
    return seconds + (time.perf_counter() - start)


def _round_starts(records: np.ndarray) -> np.ndarray:
    if not len(records):
        return np.zeros(0, np.int64)
    first = {}
    for r, row0 in zip(records["round"].tolist(), records["row0"].tolist()):
        first[r] = min(first.get(r, row0), row0)
    return np.array(sorted(first.values()), dtype=np.int64)


def read_all(path: str) -> float:
    start = time.perf_counter()
    with h5py.File(path, "r") as f:
        for name in f["data"]:
            f["data"][name][()]
    return time.perf_counter() - start


def compare_seconds(path: str, workdir: str) -> float:
    report = os.path.join(workdir, "report.csv")
    start = time.perf_counter()
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "srdd-compare"), path, "-o",
                    report, "--quiet"], check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True)
    ap.add_argument("--workdir", default="/tmp/srdd-compression")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "compression.csv"))
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    rows = []
    for name, filters in VARIANTS.items():
        path = os.path.join(args.workdir, f"{name}.h5")
        writes = [rewrite(args.dump, path, filters) for _ in range(args.repeats)]
        size = os.path.getsize(path)
        read_all(path)  # warm the page cache
        reads = [read_all(path) for _ in range(args.repeats)]
        compares = [compare_seconds(path, args.workdir) for _ in range(args.repeats)]
        data_bytes = sum(ds.size * ds.dtype.itemsize
                         for ds in h5py.File(path, "r")["data"].values())
        row = {
            "variant": name, "file_bytes": size, "data_bytes": data_bytes,
            "ratio": round(size / os.path.getsize(os.path.join(args.workdir, "none.h5")), 4)
            if name != "none" else 1.0,
            "write_s": round(statistics.median(writes), 3),
            "write_MBps": round(data_bytes / 1e6 / statistics.median(writes), 1),
            "read_s": round(statistics.median(reads), 3),
            "read_MBps": round(data_bytes / 1e6 / statistics.median(reads), 1),
            "compare_s": round(statistics.median(compares), 3),
            "compare_GBps_of_uncompressed": round(data_bytes / 1e9 / statistics.median(compares),
                                                  3),
        }
        rows.append(row)
        print(row, flush=True)
        if name != "none":
            os.remove(path)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
