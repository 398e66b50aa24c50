"""Compare throughput of two source trees side by side in one run: an older commit against the
working tree, on the same dumps, runs interleaved (A B A B ...), medians reported.

    python bench/ab_compare.py --old COMMIT [--repeats 5] [--workdir DIR] [--samples 16]

Each run is one child process calling the compare of its tree as the srdd-compare command does
(bench/perf.py --run-compare: compare, CSV report, glibc setting at the entry point), with
PYTHONPATH set to that tree; its time excludes imports. The dumps are SmolLM2 runs made with the
working tree's capture (the dump format is the same for both): a default scan for the
reference-free mode and a capture-only pair (golden, noise at layer 10) for the baseline mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)


def dump_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def make_dumps(workdir: str, samples: int, tokens: int) -> dict[str, str]:
    from perf import make_scan_dump

    out = {}
    for name, config in (("scan", {}), ("golden", {"probes": "none"}),
                         ("mine", {"probes": "none", "inject": ["noise@layer=10,m=0.01"]})):
        folder = os.path.join(workdir, name)
        if not os.path.isdir(folder) or not os.listdir(folder):
            n = samples if name == "scan" else samples * 4
            make_scan_dump(folder, n, tokens, **config)
        out[name] = folder
    return out


def run_one(tree: str, spec: dict) -> float:
    env = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run([sys.executable, os.path.join(tree, "bench", "perf.py"),
                           "--run-compare", json.dumps(spec)], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: compare failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="commit to compare the working tree with")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=121)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "srdd-ab"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ab_compare.json"))
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    old_tree = os.path.join(args.workdir, "old-tree")
    if not os.path.isdir(old_tree):
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", old_tree, args.old],
                       check=True, capture_output=True)
    else:
        subprocess.run(["git", "-C", old_tree, "checkout", "-q", "--detach", args.old],
                       check=True)
    dumps = make_dumps(args.workdir, args.samples, args.tokens)
    cases = []
    for jobs in (1, 2):
        cases.append(("reference-free", jobs, {"mode": "reference-free", "dumps": dumps["scan"],
                                               "jobs": jobs}, dump_bytes(dumps["scan"])))
        cases.append(("baseline", jobs, {"mode": "baseline", "dumps": dumps["mine"],
                                         "baseline": dumps["golden"], "jobs": jobs},
                      dump_bytes(dumps["mine"]) + dump_bytes(dumps["golden"])))
    rows = []
    for mode, jobs, spec, nbytes in cases:
        spec = dict(spec, output=os.path.join(args.workdir, f"r_{mode}_{jobs}.csv"))
        times = {"old": [], "new": []}
        run_one(ROOT, spec)  # page cache warm for both
        for _ in range(args.repeats):
            times["old"].append(run_one(old_tree, spec))
            times["new"].append(run_one(ROOT, spec))
        old, new = (statistics.median(times[k]) for k in ("old", "new"))
        rows.append({"mode": mode, "jobs": jobs, "bytes": nbytes, "old_s": old, "new_s": new,
                     "old_mb_s": nbytes / old / 1e6, "new_mb_s": nbytes / new / 1e6,
                     "new_over_old_throughput": old / new, "times": times})
        print(f"{mode:15s} -j {jobs}: {nbytes / 1e6:.0f} MB, old {old:.3f} s "
              f"({nbytes / old / 1e6:.0f} MB/s), new {new:.3f} s ({nbytes / new / 1e6:.0f} MB/s)"
              f", new/old throughput {old / new:.3f}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"old": args.old, "repeats": args.repeats, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
