"""Cost of the float64 host replay (--reference host): host seconds and peak host memory per
block, for SmolLM2-135M and the Qwen2-0.5B shape, at several prompt lengths; and the measured
float64 rate, from which docs/benchmarks.md projects 7B and 70B models.

    python bench/host_cost.py [--tokens 128 512 2048] [--out bench/results/host_cost.csv]

Each model runs in a fresh process: its peak RSS before the replays and after them give the
replays' peak memory (resource.getrusage; the replays run after a plain forward, so the model's
own peak is already counted).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _models import write_rows  # noqa: E402


def measure(name: str, tokens: int, threads: int) -> dict:
    import torch
    from _models import build, prompts

    from srdd_dump.capture.discovery import find_blocks
    from srdd_dump.capture.host import host_replay

    torch.set_num_threads(threads)
    model = build(name)
    blocks = find_blocks(model)
    calls: list[tuple] = []
    handles = [b.register_forward_pre_hook(
        lambda m, a, k: calls.append((m, a, k)), with_kwargs=True) for _, b in blocks]
    (ids,) = prompts(model, tokens, 1)
    with torch.no_grad():
        t = time.perf_counter()
        model(input_ids=ids)
        forward = time.perf_counter() - t
    for h in handles:
        h.remove()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for module, args, kwargs in calls:
        t = time.perf_counter()
        host_replay(module, args, kwargs)
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = sum(p.numel() for p in blocks[0][1].parameters())
    per_block = sorted(times)[len(times) // 2]
    return {
        "model": name, "tokens": tokens, "threads": threads, "layers": len(blocks),
        "params_per_block": params, "host_s_per_block": round(per_block, 4),
        "host_s_all_blocks": round(sum(times), 3), "device_forward_s": round(forward, 3),
        "peak_extra_mb": round((peak - before) / 1024, 1),
        # 2 flops per parameter and token (the matmuls), in float64
        "gflops_f64": round(2 * params * tokens / per_block / 1e9, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--models", nargs="+", default=["smollm2", "qwen05"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "host_cost.csv"))
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.threads)))
        return
    rows = []
    for name in args.models:
        for tokens in args.tokens:
            out = subprocess.run([sys.executable, __file__, "--one", name, str(tokens),
                                  "--threads", str(args.threads)],
                                 capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
