"""How fast srdd-compare reads an msprobe dump: the whole command, cold (the dump converted into
srdd files first: format/from_msprobe.py) and warm (the converted files kept in the temporary
folder), reference-free and as the golden side of --baseline against itself.

    python bench/msprobe_read.py DUMP [--repeats 3] [--out bench/results/msprobe_read.json]

Make a large dump with fixtures/msprobe/make_fixtures.py --big DIR (fp32, tensor, L0,
data_mode all, the three block classes). Prints one JSON line: the dump's size and file count,
the bytes of the tensors the compare reads (the converted files' size), and per case the
median wall time, the throughput over the dump's size and over the bytes read, and the peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from srdd_dump.compare.sources import cache_root  # noqa: E402
from srdd_dump.format.from_msprobe import cache_folder  # noqa: E402


def size(folder: str) -> tuple[int, int]:
    files = [os.path.join(d, n) for d, _, names in os.walk(folder) for n in names]
    return sum(os.path.getsize(f) for f in files), len(files)


def run(args: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (MB) of one srdd-compare process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    command = os.path.join(os.path.dirname(sys.executable), "srdd-compare")
    proc = subprocess.run([command, *args],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    peak = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return wall, peak // 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    dump = os.path.abspath(a.dump)
    cache = cache_folder(dump, cache_root())
    work = tempfile.mkdtemp(prefix="msprobe-read-")
    report = os.path.join(work, "r.csv")
    cases = {
        "reference-free, cold": (["--quiet", dump, "-o", report], True),
        "reference-free, warm": (["--quiet", dump, "-o", report], False),
        "baseline against itself, warm": (["--quiet", dump, "--baseline", dump, "-o", report],
                                          False),
    }
    dump_bytes, dump_files = size(dump)
    out = {"dump": dump, "dump_bytes": dump_bytes, "dump_files": dump_files,
           "machine": f"{os.cpu_count()} cpu, {platform.processor() or platform.machine()}",
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "cases": {}}
    for name, (args, cold) in cases.items():
        walls, peaks = [], []
        for _ in range(a.repeats):
            if cold:
                shutil.rmtree(cache, ignore_errors=True)
            wall, peak = run(args)
            walls.append(wall)
            peaks.append(peak)
        median = statistics.median(walls)
        out["cases"][name] = {"walls_s": [round(w, 3) for w in walls], "median_s": round(median, 3),
                              "dump_gb_per_s": round(dump_bytes / median / 1e9, 3),
                              "peak_rss_mb": max(peaks)}
    read_bytes, _ = size(cache)
    out["tensor_bytes_read"] = read_bytes
    for case in out["cases"].values():
        case["read_gb_per_s"] = round(read_bytes / case["median_s"] / 1e9, 3)
    shutil.rmtree(work, ignore_errors=True)
    line = json.dumps(out)
    print(line)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(line + "\n")


if __name__ == "__main__":
    main()
