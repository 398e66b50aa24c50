"""The whole `srdd-compare DUMP -o report.csv` command, timed end to end (issue 29).

    python bench/compare_speed.py --workdir DIR [--make] [--repeats 7] [--probed N] [--shots K]
        [--tree NAME=PATH ...] [--relayout] [--out bench/results/compare_speed_issue29.json]

With ``--make`` the dumps are made as ``make demo`` makes its dump: ``srdd-dump --exec
"python fixtures/infer_smollm2.py --prompts 8"`` into DIR/full, and the same run with
``--store stats`` into DIR/stats (an existing dump there is reused). ``--probed N`` adds the
same run with ``--probe-samples N`` (DIR/full_probedN); ``--shots K`` the default capture of
the demo's prompts each after K worked examples, as a few-shot GSM8K evaluation prompts
(DIR/full_shotsK; K=2: about 0.85 GB). ``--relayout`` also writes the full dump in the
schema-4 layout (one record per probe output) into DIR/full_v4, so both layouts are timed
with the same code. Each timing is a whole process as a user types it (interpreter start,
imports, report written, default ``-j``), page cache warm; the runs of all commands
alternate, ``--repeats`` each after one warm-up, and the medians are reported with the CPU
time of the command and its children and the load average around each run. ``cat`` of the
dump's files is the disk-speed floor, ``srdd-compare --version`` the start-up floor.
``--tree NAME=PATH`` adds the srdd-compare of another source tree (e.g. a ``git worktree`` of
an older commit: its ``srdd_dump`` imported through PYTHONPATH, its ``cli/`` linked as
``srdd_dump/cli``) on the dumps of ``--tree-on`` (default: the schema-4 copy and the stats
dump, which an older tree reads).
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
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)
DEMO = "python fixtures/infer_smollm2.py --prompts 8"
# another tree's command as its console script runs it (cli/compare_command.py: numpy's BLAS
# at one thread before numpy loads; a tree before that file: its cli/compare.py)
SHIM = ("import sys\ntry:\n    from srdd_dump.cli.compare_command import main\n"
        "except ImportError:\n    from srdd_dump.cli.compare import main\n"
        "sys.argv[0] = 'srdd-compare'\nsys.exit(main())")


def dump_files(path: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
                  if f.endswith(".h5"))


def dump_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in dump_files(path))


def make_dump(folder: str, *store: str, script: str = DEMO) -> str:
    if dump_files(folder):
        return folder
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    subprocess.run([os.path.join(BIN, "srdd-dump"), *store, "--exec", script, "-o", folder],
                   cwd=ROOT, env=env, check=True)
    return folder


def relayout(source: str, target: str, version: int) -> str:
    """The dump's files written again in the layout of schema ``version`` (same rounds,
    records, meta and status; the records of a round in the order the reader lists them)."""
    import h5py
    import numpy as np

    from srdd_dump.format import schema as s
    from srdd_dump.format.reader import DumpReader
    from srdd_dump.format.writer import DumpWriter, Round, Tensor

    if dump_files(target):
        return target
    for path in dump_files(source):
        out = os.path.join(target, os.path.relpath(path, source))
        with DumpReader(path) as rd, h5py.File(path, "r") as f:
            w = DumpWriter(out, rd.meta, rd.layers, rd.sites, max_pending=0, version=version)
            stored = {name: f[s.DATA][name] for name in rd.data_names}
            rows, positions, tokens = rd.all_probe_rows(), rd.all_positions(), f[s.TOKEN_IDS][()]
            for row in rd.rounds:
                mine = rd.records[rd.records["round"] == row["round"]]
                tensors = []
                for rec in mine:
                    name = rd.data_names[int(rec["data"])]
                    a = stored[name][int(rec["row0"]): int(rec["row0"]) + int(rec["nrows"])]
                    tensors.append(Tensor(
                        layer=int(rec["layer"]), site=int(rec["site"]), dtype=rd.dtype_of(rec),
                        array=a.reshape(int(rec["batch"]), int(rec["ntok"]), -1),
                        kind=int(rec["kind"]), probe=int(rec["probe"]),
                        param=float(rec["param"]), seed=int(rec["seed"]),
                        pert_rms=float(rec["pert_rms"]), subset=bool(rec["subset"])))
                off, n = int(row["tok_off"]), int(row["tok_len"])
                p0, pn = int(row["prow_off"]), int(row["prow_len"])
                q0 = int(row["pos_off"])
                w.submit(Round(
                    sample=int(row["sample"]), step=int(row["step"]), batch=int(row["batch"]),
                    seq=int(row["seq"]), positions=positions[q0: q0 + int(row["ntok"])],
                    token_ids=tokens[off: off + n].reshape(int(row["batch"]), -1) if n else None,
                    probe_rows=rows[p0: p0 + pn] if pn else None, time=float(row["time"]),
                    tensors=tensors))
            status = dict(rd.status)
            status.pop("rounds", None)
            w.close(status)
            with h5py.File(out, "r+") as g:
                g.attrs[s.ATTR_COMPLETE] = f.attrs[s.ATTR_COMPLETE]
        assert np  # used through the reader's arrays
    return target


def timed(cmd: list[str], env: dict | None = None, cwd: str | None = None) -> dict:
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "load1": load}


def commands(args, dumps: dict[str, str], report: str) -> dict[str, tuple[list[str], dict]]:
    compare = os.path.join(BIN, "srdd-compare")
    # an installed package has its .pyc files (pip compiles them); a machine that sets
    # PYTHONDONTWRITEBYTECODE would compile every module of every run (0.1 s)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out: dict[str, tuple[list[str], dict]] = {
        "startup (srdd-compare --version)": ([compare, "--version"], env)}
    for name, folder in dumps.items():
        out[f"cat {name}"] = (["cat", *dump_files(folder)], env)
        out[f"srdd-compare {name}"] = ([compare, folder, "-o", report, "-q"], env)
        for tree in args.tree if name in args.tree_on.split(",") else ():
            label, _, path = tree.partition("=")
            tree_env = dict(env, PYTHONPATH=os.path.abspath(path))
            out[f"srdd-compare {name} [{label}]"] = (
                [sys.executable, "-c", SHIM, folder, "-o", report, "-q"], tree_env)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--make", action="store_true", help="make the dumps that are missing")
    ap.add_argument("--relayout", action="store_true",
                    help="also time the full dump written in the schema-4 layout")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--probed", type=int, metavar="N",
                    help="also the full dump of the same run with --probe-samples N "
                    "(DIR/full_probedN)")
    ap.add_argument("--shots", type=int, metavar="K",
                    help="also the default capture of the demo's prompts after K worked "
                    "examples each (DIR/full_shotsK)")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--tree-on", default="full_v4,stats",
                    help="the dumps the --tree commands compare (an older tree reads no "
                    "newer schema)")
    ap.add_argument("--out", default=os.path.join(HERE, "results",
                                                  "compare_speed_issue29.json"))
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    dumps = {}
    made = [("full", (), DEMO), ("stats", ("--store", "stats"), DEMO)]
    if args.probed:
        made.append((f"full_probed{args.probed}", ("--probe-samples", str(args.probed)), DEMO))
    if args.shots:
        made.append((f"full_shots{args.shots}", (), f"{DEMO} --shots {args.shots}"))
    for name, store, script in made:
        folder = os.path.join(args.workdir, name)
        if args.make:
            make_dump(folder, *store, script=script)
        if dump_files(folder):
            dumps[name] = folder
    if args.relayout and "full" in dumps:
        dumps["full_v4"] = relayout(dumps["full"], os.path.join(args.workdir, "full_v4"), 4)
    report = os.path.join(args.workdir, "report", "report.csv")
    os.makedirs(os.path.dirname(report), exist_ok=True)
    runs = commands(args, dumps, report)
    times: dict[str, list[dict]] = {name: [] for name in runs}
    for cmd, env in runs.values():  # warm-up: page cache, .pyc files
        timed(cmd, env, args.workdir)  # not ROOT: `python -c` would import its srdd_dump
    for _ in range(args.repeats):
        for name, (cmd, env) in runs.items():
            times[name].append(timed(cmd, env, args.workdir))
    sizes = {name: dump_bytes(folder) for name, folder in dumps.items()}
    summary = {}
    for name, runs_of in times.items():
        wall = statistics.median(r["wall"] for r in runs_of)
        cpu = statistics.median(r["cpu"] for r in runs_of)
        dump = next((d for d in sorted(sizes, key=len, reverse=True)
                     if name.split(" [")[0].endswith(" " + d)), None)
        summary[name] = {"median_wall_s": round(wall, 3), "median_cpu_s": round(cpu, 3),
                         "walls": [round(r["wall"], 3) for r in runs_of],
                         "load1": [round(r["load1"], 2) for r in runs_of]}
        if dump:
            summary[name]["dump_bytes"] = sizes[dump]
            summary[name]["GB_per_s"] = round(sizes[dump] / wall / 1e9, 3)
        print(f"{name:48s} {wall:7.3f} s  cpu {cpu:6.3f} s"
              + (f"  {sizes[dump] / wall / 1e9:6.3f} GB/s" if dump else ""))
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "python": platform.python_version(), "repeats": args.repeats,
        "dumps": {name: {"path": folder, "bytes": sizes[name]} for name, folder in dumps.items()},
        "trees": args.tree, "summary": summary,
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        if shutil.which("uptime") else "",
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
