"""Cost of the default scan as a user pays it: the whole plain script against the same script
under ``srdd-dump --exec`` (interpreter start, imports, model load, generation, the dump's
close), as whole processes, alternated pair by pair after a warm-up pair; medians.

    python bench/whole_script.py [--model smollm2|gemma3] [--prompts 8] [--new-tokens 8]
                                 [--pairs 5] [--out JSON] [-- SRDD-DUMP OPTIONS ...]
"""

from __future__ import annotations

import argparse
import json
import os
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


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SCRIPTS), default="smollm2")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("options", nargs="*", help="srdd-dump options (after --)")
    args = ap.parse_args()
    script = (f"{shlex.quote(sys.executable)} {SCRIPTS[args.model]} --prompts {args.prompts} "
              f"--new-tokens {args.new_tokens}")
    srdd = shutil.which("srdd-dump") or "srdd-dump"
    plain_s, scan_s, ratios = [], [], []
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
        scan, plain = took["scan"], took["plain"]
        if i:
            scan_s.append(scan)
            plain_s.append(plain)
            ratios.append(scan / plain)
        print(f"pair {i}{' (warm-up)' if not i else ''}: scan {scan:.2f} s, plain {plain:.2f} s",
              flush=True)
    result = {"model": args.model, "prompts": args.prompts, "new_tokens": args.new_tokens,
              "options": args.options, "plain_s": plain_s, "scan_s": scan_s,
              "ratio_median": statistics.median(ratios), "ratios": ratios,
              "load_average": os.getloadavg()}
    print(f"whole script: plain {statistics.median(plain_s):.2f} s, scan "
          f"{statistics.median(scan_s):.2f} s, median ratio {result['ratio_median']:.2f}x "
          f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
