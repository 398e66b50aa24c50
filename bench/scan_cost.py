"""Cost of the default scan on a user's generation script, by part: SmolLM2-135M (fp32), greedy
generation of NEW tokens for PROMPTS chat prompts (fixtures/infer_smollm2.py's work), plain and
under capture with several configurations, in one process, interleaved, medians.

    python bench/scan_cost.py [--prompts 8] [--new-tokens 8] [--repeats 3]
                              [--model smollm2|gemma3] [--only CONFIG ...] [--tokens N]

``--tokens N``: each prompt's text repeated to about N tokens (a long prompt, as a few-shot
GSM8K prompt is).

``--model gemma3``: the real Gemma 3 270M (fixtures/gemma3.py; plain-text prompts).

The model load (a few seconds from the safetensors cache) is measured once and added to every
configuration, so "whole script" ratios are what `srdd-dump --exec` costs a user's run.
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

CONFIGS = {
    "default": {},
    "block, prefill only (the former default)": {"granularity": "block", "steps": "0"},
    "sub-layers, prefill only": {"steps": "0"},
    "default, no decode probes": {"probe_steps": "0"},
    "default, steps 1 and 7 probed (the default before 2026-11-28)": {"probe_steps": "0,1,7"},
    "default, every sample probed": {"probe_samples": 1000},
    "default, 4 samples probed (the default before 2026-11-26 night)": {"probe_samples": 4},
    "default, 2 samples probed": {"probe_samples": 2},
    "capture only (no probes)": {"probes": "none"},
    "default without the causality probe": {"probes": "gain,dc,repeat,scale,attention,mlp"},
    "default without the sub-layer references": {"probes": "gain,dc,repeat,scale,causal"},
    "default without the norm sites": {"sublayers": "self_attn,mlp"},
    "default, no repeats": {"repeats": 0},
    "default, no gain or dc": {"probes": "repeat,scale,causal,attention,mlp,norm"},
    "hunt: --granularity op": {"granularity": "op"},
    "hunt: --granularity op --reference host": {"granularity": "op", "reference": "host"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "scan_cost.json"))
    ap.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    ap.add_argument("--only", nargs="*", help="only these configurations (names above)")
    ap.add_argument("--tokens", type=int, help="each prompt repeated to about this many tokens")
    ap.add_argument("--cpu", action="store_true",
                    help="one torch thread, CPU time of the process (steady on a shared "
                         "machine) instead of wall time")
    args = ap.parse_args()
    import torch

    clock = time.process_time if args.cpu else time.perf_counter
    if args.cpu:
        torch.set_num_threads(1)

    from srdd_dump import DumpConfig, register_hook

    if args.model == "gemma3":
        from gemma3 import load
    else:
        from smollm2 import load

    t = clock()
    model, tok = load("float32")
    load_s = clock() - t
    with open(os.path.join(HERE, "..", "fixtures", "prompts.txt")) as fh:
        prompts = [line.strip() for line in fh if line.strip()][: args.prompts]
    if args.tokens:
        prompts = [" ".join([p] * max(1, args.tokens // len(tok(p).input_ids))) for p in prompts]
    if args.model == "gemma3":  # a base model: plain text
        ids = [tok(p, return_tensors="pt").input_ids for p in prompts]
    else:
        ids = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True),
                   return_tensors="pt").input_ids for p in prompts]
    configs = {k: v for k, v in CONFIGS.items() if not args.only or k in args.only}

    def generate() -> None:
        with torch.no_grad():
            for x in ids:
                model.generate(x, max_new_tokens=args.new_tokens, do_sample=False)

    def captured(config: dict) -> float:
        tmp = tempfile.mkdtemp()
        try:
            start = clock()
            with register_hook(model, DumpConfig(dump_path=tmp, progress=False, **config)):
                generate()
            return clock() - start
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    generate()  # warm-up
    times: dict[str, list[float]] = {"plain": [], **{k: [] for k in configs}}
    for _ in range(args.repeats):
        start = clock()
        generate()
        times["plain"].append(clock() - start)
        for name, config in configs.items():
            times[name].append(captured(config))
    plain = statistics.median(times["plain"])
    rows = []
    for name, values in times.items():
        med = statistics.median(values)
        rows.append({"config": name, "generate_s": med, "vs_plain": med / plain,
                     "whole_script_vs_plain": (med + load_s) / (plain + load_s)})
        print(f"{name:45s} {med:7.2f} s  x{med / plain:5.2f} of the generation, "
              f"x{(med + load_s) / (plain + load_s):5.2f} of the whole script", flush=True)
    print(f"model load {load_s:.1f} s")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"model": args.model, "clock": "cpu" if args.cpu else "wall",
                   "load_s": load_s, "prompts": args.prompts, "tokens": [x.shape[1] for x in ids],
                   "new_tokens": args.new_tokens,
                   "rows": rows, "times": times}, fh, indent=1)


if __name__ == "__main__":
    main()
