"""msprobe side of bench/perf.py; run with a Python that has ``mindstudio-probe`` installed.

    python bench/msprobe_bench.py dump --model smollm2 --out DIR [--tokens 121] [--repeats 5]
                                       [--data-mode output|all] [--samples N] [--inject SPEC]
    python bench/msprobe_bench.py compare --target DIR --golden DIR --out DIR

``dump`` times forwards dumped with msprobe's PrecisionDebugger, each after a forward of an
unhooked copy of the model (msprobe's hooks stay on a model once started), at the granularity
of srdd-dump's capture:
task ``tensor``, level ``L0`` (modules), ``list`` = ["DecoderLayer"] (msprobe matches list
entries as substrings of names like ``Module.model.layers.4.LlamaDecoderLayer.forward.0``, so
this keeps exactly the decoder layers), ``data_mode`` output (the tensors srdd-dump keeps) or
all (inputs too, msprobe's default). With ``--samples N`` it dumps N prompts (one step each)
for ``compare`` instead of timing. ``compare`` runs ``msprobe compare -tp -gp`` on every step
in this process (import time excluded) and times the total. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, ".."))  # srdd_dump, for the fault simulator
from _models import build, du, prompts  # noqa: E402


def dump(args) -> dict:
    import copy

    from msprobe.pytorch import PrecisionDebugger

    torch.set_num_threads(os.cpu_count() or 1)
    model = build(args.model)
    if args.inject:
        from srdd_dump.capture.discovery import find_blocks
        from srdd_dump.capture.faults import install_faults
        from srdd_dump.capture.faultspec import parse_fault

        install_faults(model, find_blocks(model, None), [parse_fault(args.inject)])
    n = args.samples or args.repeats
    ids = prompts(model, args.tokens, n if args.samples else 1)
    # timing: a copy of the model msprobe never hooks, run between the dumped forwards
    plain_model = None if args.samples else copy.deepcopy(model)
    before = []
    with torch.no_grad():
        for _ in range(2):
            model(input_ids=ids[0])
        if plain_model is not None:
            for _ in range(3):
                before.append(_timed(plain_model, ids[0]))
    config = {
        "task": "tensor", "dump_path": args.out, "rank": [], "step": [], "level": "L0",
        "async_dump": False,
        "tensor": {"scope": [], "list": ["DecoderLayer"], "data_mode": [args.data_mode]},
    }
    os.makedirs(args.out, exist_ok=True)
    cfg_path = os.path.join(args.out, "..", f"msprobe_config_{os.getpid()}.json")
    with open(cfg_path, "w") as fh:
        json.dump(config, fh)
    log = io.StringIO()
    dumped, plain = [], []
    with contextlib.redirect_stdout(log), torch.no_grad():
        debugger = PrecisionDebugger(config_path=cfg_path)
        for i in range(n):
            x = ids[i] if args.samples else ids[0]
            if plain_model is not None:
                plain.append(_timed(plain_model, x))
            t = time.perf_counter()
            debugger.start(model=model)
            model(input_ids=x)
            debugger.stop()
            debugger.step()
            dumped.append(time.perf_counter() - t)
    os.remove(cfg_path)
    size, files = du(args.out)
    out = {"model": args.model, "tokens": args.tokens, "data_mode": args.data_mode,
           "forwards": n, "bytes": size, "files": files,
           "bytes_per_forward": size / n, "files_per_forward": files / n,
           "dumped_s": statistics.median(dumped[1:] if n > 2 else dumped)}
    if plain:
        out["plain_before_s"] = statistics.median(before)
        out["plain_s"] = statistics.median(plain[1:] if n > 2 else plain)
        # each dumped forward against the plain forward just before it, as bench/perf.py
        # measures srdd-dump: drifts of the machine cancel in the pair
        pairs = list(zip(plain, dumped))[1:] if n > 2 else list(zip(plain, dumped))
        out["ratio"] = statistics.median(d / p for p, d in pairs)
        out["ratio_of_medians"] = out["dumped_s"] / out["plain_s"]
    return out


def _timed(model, ids) -> float:
    t = time.perf_counter()
    model(input_ids=ids)
    return time.perf_counter() - t


def compare(args) -> dict:
    from msprobe.msprobe import main as msprobe_main

    steps = sorted(d for d in os.listdir(args.target) if d.startswith("step"))
    log = io.StringIO()
    t = time.perf_counter()
    for step in steps:
        sys.argv = ["msprobe", "compare", "-tp", os.path.join(args.target, step),
                    "-gp", os.path.join(args.golden, step), "-o", args.out]
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            try:
                msprobe_main()
            except SystemExit:
                pass
    elapsed = time.perf_counter() - t
    size = du(args.target)[0] + du(args.golden)[0]
    results = [f for f in os.listdir(args.out) if f.endswith(".csv")]
    rows = 0
    for name in results:
        with open(os.path.join(args.out, name)) as fh:
            rows += max(0, sum(1 for _ in fh) - 1)
    return {"steps": len(steps), "bytes": size, "seconds": elapsed,
            "mb_per_s": size / elapsed / 1e6, "result_files": len(results), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--model", default="smollm2")
    d.add_argument("--tokens", type=int, default=121)
    d.add_argument("--repeats", type=int, default=5)
    d.add_argument("--samples", type=int, default=0)
    d.add_argument("--data-mode", default="output", choices=("output", "all"))
    d.add_argument("--inject")
    d.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("--target", required=True)
    c.add_argument("--golden", required=True)
    c.add_argument("--out", required=True)
    args = ap.parse_args()
    result = dump(args) if args.cmd == "dump" else compare(args)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
