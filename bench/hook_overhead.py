"""The Python cost of the capture's hooks on the decode steps nobody captures: SmolLM2-135M
(fp32) generating NEW tokens from one chat prompt, plain and under ``register_hook`` with only
the prefill captured (``--steps 0 --probes none``), so every decode step runs through the
hooks of all sites without a round to record; one torch thread, CPU time, interleaved,
medians. The difference per decode step is the hooks' own overhead.

    python bench/hook_overhead.py [--new-tokens 64] [--repeats 5] [--out JSON]
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
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from srdd_dump import DumpConfig, register_hook

    from smollm2 import load

    torch.set_num_threads(1)
    model, tok = load("float32")
    ids = tok(tok.apply_chat_template([{"role": "user", "content": "Count to fifty."}],
                                      tokenize=False, add_generation_prompt=True),
              return_tensors="pt").input_ids

    def generate(tokens: int) -> None:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens,
                           do_sample=False)

    def timed(hooked: bool, tokens: int) -> float:
        tmp = tempfile.mkdtemp()
        try:
            start = time.process_time()
            if hooked:
                with register_hook(model, DumpConfig(dump_path=tmp, steps="0", probes="none",
                                                     samples=2, progress=False)):
                    generate(tokens)
            else:
                generate(tokens)
            return time.process_time() - start
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    with register_hook(model, DumpConfig(dump_path=tempfile.mkdtemp(), progress=False)) as s:
        sites, blocks = len(s.sites), len(s.blocks)
    generate(4)
    runs: dict[str, list[float]] = {"plain": [], "hooks": [], "plain_1": [], "hooks_1": []}
    for _ in range(args.repeats):
        runs["plain"].append(timed(False, args.new_tokens))
        runs["hooks"].append(timed(True, args.new_tokens))
        runs["plain_1"].append(timed(False, 1))
        runs["hooks_1"].append(timed(True, 1))
    med = {k: statistics.median(v) for k, v in runs.items()}
    steps = args.new_tokens - 1
    plain_step = (med["plain"] - med["plain_1"]) / steps
    hooks_step = (med["hooks"] - med["hooks_1"]) / steps
    result = {"new_tokens": args.new_tokens, "medians_cpu_s": med, "runs": runs,
              "plain_decode_step_ms": 1e3 * plain_step,
              "hooked_decode_step_ms": 1e3 * hooks_step, "sites": sites, "blocks": blocks,
              "load_average": os.getloadavg()}
    print(f"decode step: plain {1e3 * plain_step:.2f} ms, with the hooks of {sites} sites and "
          f"{blocks} blocks {1e3 * hooks_step:.2f} ms (x{hooks_step / plain_step:.3f}; "
          f"{1e6 * (hooks_step - plain_step) / (sites + blocks):.1f} us per hooked module)")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
