"""Cost of the default scan as a user pays it: the whole plain script against the same script
under ``srdd-dump --exec`` (interpreter start, imports, model load, generation, the dump's
close), as whole processes, alternated pair by pair after a warm-up pair; medians.

    python bench/whole_script.py [--model smollm2|gemma3] [--prompts 8] [--new-tokens 8]
                                 [--pairs 5] [--dtype float32|bfloat16] [--device cpu|cuda]
                                 [--out JSON] [-- SRDD-DUMP OPTIONS ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPTS = {"smollm2": "fixtures/infer_smollm2.py", "gemma3": "fixtures/infer_gemma3.py"}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of a whole process and its descendants: the CPU time is steady
    on a shared machine where the wall time is not."""
    start, cpu = time.perf_counter(), _children_cpu()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - start, _children_cpu() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SCRIPTS), default="smollm2")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", help="smollm2 only: where the script runs")
    ap.add_argument("--out", default=None)
    ap.add_argument("options", nargs="*", help="srdd-dump options (after --)")
    args = ap.parse_args()
    if args.device != "cpu" and args.model != "smollm2":
        ap.error("--device: only the smollm2 script takes it")
    script = (f"{shlex.quote(sys.executable)} {SCRIPTS[args.model]} --prompts {args.prompts} "
              f"--new-tokens {args.new_tokens} --dtype {args.dtype}")
    if args.device != "cpu":
        script += f" --device {args.device}"
    srdd = shutil.which("srdd-dump") or "srdd-dump"
    plain_s, scan_s, ratios = [], [], []
    plain_cpu, scan_cpu, cpu_ratios = [], [], []
    for i in range(args.pairs + 1):  # the first pair warms the caches, not counted
        out = tempfile.mkdtemp(prefix="srdd-whole-")
        order = ("plain", "scan") if i % 2 else ("scan", "plain")  # alternated within pairs
        took = {}
        for which in order:
            if which == "scan":
                try:
                    took[which] = timed([srdd, "--exec", script, "-o", out, *args.options])
                finally:
                    shutil.rmtree(out, ignore_errors=True)
            else:
                took[which] = timed(shlex.split(script))
        (scan, scan_c), (plain, plain_c) = took["scan"], took["plain"]
        if i:
            scan_s.append(scan)
            plain_s.append(plain)
            ratios.append(scan / plain)
            scan_cpu.append(scan_c)
            plain_cpu.append(plain_c)
            cpu_ratios.append(scan_c / plain_c)
        print(f"pair {i}{' (warm-up)' if not i else ''}: scan {scan:.2f} s ({scan_c:.2f} s CPU), "
              f"plain {plain:.2f} s ({plain_c:.2f} s CPU)", flush=True)
    result = {"model": args.model, "prompts": args.prompts, "new_tokens": args.new_tokens,
              "dtype": args.dtype, "device": args.device,
              "options": args.options, "plain_s": plain_s, "scan_s": scan_s,
              "ratio_median": statistics.median(ratios), "ratios": ratios,
              "plain_cpu_s": plain_cpu, "scan_cpu_s": scan_cpu,
              "cpu_ratio_median": statistics.median(cpu_ratios), "cpu_ratios": cpu_ratios,
              "load_average": os.getloadavg(), "pythonpath": os.environ.get("PYTHONPATH")}
    print(f"whole script: plain {statistics.median(plain_s):.2f} s, scan "
          f"{statistics.median(scan_s):.2f} s, median ratio {result['ratio_median']:.2f}x "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}); CPU time: plain "
          f"{statistics.median(plain_cpu):.2f} s, scan {statistics.median(scan_cpu):.2f} s, "
          f"median ratio {result['cpu_ratio_median']:.2f}x "
          f"(range {min(cpu_ratios):.2f}-{max(cpu_ratios):.2f})")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
