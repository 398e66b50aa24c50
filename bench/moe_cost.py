"""Cost of the default scan on the upcycled SmolLM2-MoE (E=4, top-2; transformers' eager
experts loop): the plain generation against the same generation under capture, interleaved.

    python bench/moe_cost.py [--repeats 3] [--prompts 8] [--dense] [--cpu] [--probe-samples N]
                             [--probe-steps STEPS] [--probes WORDS] [--set FIELD=VALUE ...]

The default work is the dense figure's (bench/scan_cost.py): the first 8 chat prompts, 8 new
tokens each, so the default scan captures its 8 samples (--samples 8) and probes the first.
Fewer prompts spread the probes' fixed cost over fewer tokens (2 prompts: about twice the
ratio, for the dense model as for the MoE one). ``--probes none`` measures the capture without
a replay (hooks, records, the file written): the floor every probe's cost adds to. ``--set
draws=1`` (any DumpConfig field, an int or a float or a word) measures another default.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "fixtures"))
sys.path.insert(0, HERE)

from detect import NEW_TOKENS, prompt_ids  # noqa: E402

from srdd_dump import DumpConfig, register_hook  # noqa: E402

from moe_models import upcycle_smollm2  # noqa: E402


def generate(model, ids) -> None:
    with torch.no_grad():
        for x in ids:
            model.generate(x, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


def config_fields(pairs: list[str]) -> dict:
    """["draws=1", "sigmas=0.1"] -> {"draws": 1, "sigmas": [0.1]}: a list field takes commas."""
    fields = {}
    for pair in pairs:
        name, _, text = pair.partition("=")
        numeric = name in ("samples", "seed", "probe_samples", "draws", "repeats", "sigmas", "dc")
        values = [_number(v) if numeric else v for v in text.split(",")]
        fields[name] = values if name in ("sigmas", "dc") else values[0]
    return fields


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--dense", action="store_true", help="SmolLM2 itself, for comparison")
    parser.add_argument("--cpu", action="store_true",
                        help="one torch thread, CPU time of the process (steady on a shared "
                             "machine) instead of wall time")
    parser.add_argument("--probe-samples", type=int,
                        help="probe this many samples instead of the default")
    parser.add_argument("--probe-steps", help="probe these steps instead of the default")
    parser.add_argument("--probes", help="these probe words instead of the default (none: "
                        "no replay at all)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a DumpConfig field of the captured runs, e.g. draws=1")
    args = parser.parse_args()
    clock = time.process_time if args.cpu else time.perf_counter
    if args.cpu:
        torch.set_num_threads(1)
    if args.dense:
        from smollm2 import load

        model, tokenizer = load("float32")
    else:
        model, tokenizer = upcycle_smollm2(4, 2)
        model.config._experts_implementation = "eager"
    ids = prompt_ids(tokenizer, 0, n=args.prompts)
    generate(model, ids[:1])  # warm-up
    plain, captured, sizes = [], [], []
    for _ in range(args.repeats):
        t = clock()
        generate(model, ids)
        plain.append(clock() - t)
        tmp = tempfile.mkdtemp(prefix="srdd-moe-cost-")
        t = clock()
        extra = {} if args.probe_samples is None else {"probe_samples": args.probe_samples}
        if args.probe_steps:
            extra["probe_steps"] = args.probe_steps
        if args.probes:
            extra["probes"] = args.probes
        extra.update(config_fields(args.set))
        with register_hook(model, DumpConfig(dump_path=tmp, samples=len(ids), progress=False,
                                             **extra)):
            generate(model, ids)
        captured.append(clock() - t)
        sizes.append(sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp)))
        shutil.rmtree(tmp)
    p, c = statistics.median(plain), statistics.median(captured)
    print(f"{'CPU' if args.cpu else 'wall'} time; tokens per prompt: "
          f"{[x.shape[1] for x in ids]}; {NEW_TOKENS} new tokens")
    print(f"plain {p:.2f} s {[round(x, 2) for x in plain]}; captured {c:.2f} s "
          f"{[round(x, 2) for x in captured]}; ratio {c / p:.2f}x; dump "
          f"{statistics.median(sizes) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
