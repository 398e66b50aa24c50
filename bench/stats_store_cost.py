"""The cost of recording an unprobed round with each store: SmolLM2-135M in bfloat16, one
forward of TOKENS random tokens, plain and under ``register_hook`` with probes on no sample
(``--probe-samples 0``), once with the default store and once with ``--store stats`` (its
reductions run on the device for every site); one torch thread, CPU time, interleaved, medians.

    python bench/stats_store_cost.py [--tokens 256] [--repeats 5] [--dtype bfloat16] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "fixtures"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from srdd_dump import DumpConfig, register_hook

    from smollm2 import load

    torch.set_num_threads(1)
    model, _ = load(args.dtype)
    ids = torch.randint(5, 40000, (1, args.tokens), generator=torch.Generator().manual_seed(0))

    def forward() -> float:
        start = time.process_time()
        with torch.no_grad():
            model(ids)
        return time.process_time() - start

    forward()
    runs: dict[str, list[float]] = {"plain": [], "sample:32768": [], "stats": []}
    for _ in range(args.repeats):
        runs["plain"].append(forward())
        for store in ("sample:32768", "stats"):
            tmp = tempfile.mkdtemp()
            try:
                with register_hook(model, DumpConfig(dump_path=tmp, samples=2, probe_samples=0,
                                                     store=store, progress=False)):
                    forward()  # the first round (the session's one-time work)
                    runs[store].append(forward())
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    for store in ("sample:32768", "stats"):
        print(f"{store:14s} {med[store]:.3f} s CPU against {med['plain']:.3f} s plain: "
              f"x{med[store] / med['plain']:.2f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"tokens": args.tokens, "dtype": args.dtype, "medians_cpu_s": med,
                       "runs": runs, "pythonpath": os.environ.get("PYTHONPATH"),
                       "load_average": os.getloadavg()}, fh, indent=1)


if __name__ == "__main__":
    main()
