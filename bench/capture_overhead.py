"""Capture-only overhead of srdd-dump on the real SmolLM2-135M (one prefill forward).

    python bench/capture_overhead.py [--tokens 121] [--repeats 15] [--dtype float32]

Times plain forwards and forwards with ``register_hook`` (every forward captured) interleaved,
and prints medians and the ratio. Bytes per captured sample come from the dump file.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures"))
from srdd_dump import DumpConfig, register_hook  # noqa: E402

from smollm2 import load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=121)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model, _ = load(args.dtype)
    ids = torch.randint(0, 49152, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    plain, captured = [], []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for _ in range(3):
            model(input_ids=ids)
        session = register_hook(model, DumpConfig(dump_path=tmp, samples=10**9))
        session.remove()
        for _ in range(args.repeats):
            t = time.perf_counter()
            model(input_ids=ids)
            plain.append(time.perf_counter() - t)
            session._install()
            t = time.perf_counter()
            model(input_ids=ids)
            captured.append(time.perf_counter() - t)
            session.remove()
        path = session.close()
        size = os.path.getsize(path)
    p, c = statistics.median(plain), statistics.median(captured)
    print(f"plain forward      median {p * 1e3:8.1f} ms  (min {min(plain) * 1e3:.1f})")
    print(f"capture forward    median {c * 1e3:8.1f} ms  (min {min(captured) * 1e3:.1f})")
    print(f"capture-only ratio {c / p:.3f}x")
    print(f"bytes per sample   {size / args.repeats / 1e6:.2f} MB ({args.tokens} tokens, "
          f"{len(session.layer_names)} layers + stack input, {args.dtype})")


if __name__ == "__main__":
    main()
