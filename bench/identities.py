"""Healthy values of the exact identities and of the host replay (docs/method.md): every
linear operator's scale identity, every causal block/attention's causality identity, and the
relative distance of every module to its float64 host replay, per role, on healthy runs of
SmolLM2-135M and the tiny Llama / Qwen2 / GPT-2 / BERT models in fp32, bf16 and fp16, with the
hunt options (--granularity op --reference host).

    python bench/identities.py [--out bench/results/identities.csv] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "fixtures"))
sys.path.insert(0, HERE)

from _models import write_rows  # noqa: E402
from detect import prompt_ids  # noqa: E402

from srdd_dump import DumpConfig, register_hook  # noqa: E402
from srdd_dump.compare import compare_path  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")


def measure(model, ids, decoder: bool) -> list[dict]:
    tmp = tempfile.mkdtemp(prefix="srdd-identities-")
    try:
        config = DumpConfig(dump_path=tmp, samples=len(ids), granularity="op", reference="host",
                            progress=False)
        with register_hook(model, config), torch.no_grad():
            for x in ids:
                if decoder:
                    model.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0)
                else:
                    model(input_ids=x)
        result = compare_path(tmp, progress=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table = result.sites
    blocks = result.layers.assign(role="block")
    rows = []
    for role, sub in [*table.groupby("role"), ("block", blocks)]:
        rows.append({
            "role": role, "modules": len(sub),
            "scale_broken_max": sub["scale_broken"].max(),
            "causal_broken_max": sub["causal_broken"].max(),
            "host_red_max": sub["host_red"].max(),
            "fault_rows": int((sub["verdict"] == "FAULT").sum()),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "identities.csv"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from smollm2 import load
    from tiny_models import ARCHS, build

    out = []
    for dtype in DTYPES:
        model, tok = load(dtype)
        for row in measure(model, prompt_ids(tok, 90), True):
            out.append({"model": "SmolLM2-135M", "dtype": dtype, **row})
            print(out[-1], flush=True)
        del model
        for arch in ARCHS:
            model = build(arch, dtype=getattr(torch, dtype))
            gen = torch.Generator().manual_seed(90)
            ids = [torch.randint(1, 128, (2, n), generator=gen) for n in (24, 37)]
            for row in measure(model, ids, arch != "bert"):
                out.append({"model": f"tiny {arch}", "dtype": dtype, **row})
                print(out[-1], flush=True)
    write_rows(args.out, out)


if __name__ == "__main__":
    main()
