"""Detection benchmark: plant faults in the real SmolLM2-135M and check the reference-free
diagnosis names the faulty layer. Uses only the public API (register_hook with
``DumpConfig(inject=...)``, then ``compare_path``); the diagnosis never sees the fault.

    python bench/detect.py [--quick] [--out bench/results/detect.csv] [--resume]
    python bench/detect.py --healthy-only          # calibration: healthy runs only
    python bench/detect.py --shard 0/2 --threads 1 --out a.csv &   # two cores: two shards
    python bench/detect.py --shard 1/2 --threads 1 --out b.csv; wait
    python bench/detect.py --summarize a.csv b.csv

Each case: one fault spec, one seed r (fault channel subset and srdd-dump seed) and one prompt
set r (2 prompts). Block-output faults are dumped with the default ``--granularity block``,
MLP/attention faults with ``--granularity sublayer``; healthy runs with ``sublayer`` (the
stricter test: more modules that could raise a false alarm). Healthy runs: prompt sets 0..4
in fp32 and bf16. Rows are appended to the output CSV as they finish, so ``--resume``
continues an interrupted run.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import sys
import tempfile
import time
from itertools import product

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "fixtures"))

from srdd_dump import DumpConfig, register_hook  # noqa: E402
from srdd_dump.analysis.diagnosis import relative_z, site_groups  # noqa: E402
from srdd_dump.compare import compare_path, file_signals  # noqa: E402
from srdd_dump.format.reader import find_dump_files  # noqa: E402

from smollm2 import load  # noqa: E402

TYPES = ("dead_zone", "saturation", "bias", "noise", "spike", "nondeterminism")
LAYERS = (0, 1, 2, 10, 20, 28, 29)
SITES = ("block", "mlp", "attn")
SPARSITY = (1.0, 0.1)
SEEDS = (0, 1, 2)
PROMPTS_PER_SET = 2
FIELDS = [
    "kind", "scope", "type", "sparsity", "site", "layer", "seed", "dtype", "top1", "top3", "rank",
    "predicted", "verdict_at_fault", "diagnosis_at_fault", "n_fault", "n_suspect",
    "seconds", "headline",
]


def prompt_ids(tokenizer, prompt_set: int) -> list[torch.Tensor]:
    with open(os.path.join(HERE, "..", "fixtures", "prompts.txt")) as fh:
        prompts = [line.strip() for line in fh if line.strip()]
    chosen = [prompts[(prompt_set * PROMPTS_PER_SET + i) % len(prompts)]
              for i in range(PROMPTS_PER_SET)]
    out = []
    for p in chosen:
        text = tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(tokenizer(text, return_tensors="pt").input_ids)
    return out


def run_case(model, ids, inject: list[str], seed: int, granularity: str = "sublayer"
             ) -> tuple[object, str, float]:
    tmp = tempfile.mkdtemp(prefix="srdd-detect-")
    t = time.perf_counter()
    config = DumpConfig(dump_path=tmp, samples=len(ids), granularity=granularity,
                        inject=inject, seed=seed, progress=False)
    with register_hook(model, config), torch.no_grad():
        for x in ids:
            model(input_ids=x)
    result = compare_path(tmp, progress=False)
    return result, tmp, time.perf_counter() - t


def score_case(result, layer: int | None) -> dict:
    t = result.layers
    order = list(t["layer"])
    row = {
        "predicted": order[0], "n_fault": int((t["verdict"] == "FAULT").sum()),
        "n_suspect": int((t["verdict"] == "SUSPECT").sum()),
        "headline": result.headlines[0] if result.headlines else "",
    }
    if layer is not None:
        rank = order.index(layer) + 1
        at = t[t["layer"] == layer].iloc[0]
        row.update(top1=int(rank == 1), top3=int(rank <= 3), rank=rank,
                   verdict_at_fault=at["verdict"], diagnosis_at_fault=at["diagnosis"])
    return row


def calibration_row(tmp: str) -> dict:
    """Largest healthy values of the relative z-scores and exact signals (for docs/method.md)."""
    (path,) = find_dump_files(tmp)
    sigs = file_signals(path)
    out: dict[str, float] = {}
    for group in site_groups(sigs).values():
        z = relative_z(group)
        for name, values in z.items():
            out[f"z_{name}"] = max(out.get(f"z_{name}", 0.0), float(np.nanmax(np.abs(values))))
    for name in ("zero_frac", "ties", "instability", "flat_value", "stuck", "lowbits",
                 "batch_dep"):
        vals = [getattr(g, name) for g in sigs]
        vals = [v for v in vals if np.isfinite(v)]
        out[name] = max(vals) if vals else float("nan")
    return out


def cases(quick: bool):
    if quick:
        yield from product(("dead_zone", "bias", "noise"), (1.0, 0.1), ("block", "mlp"),
                           (1, 10, 28), (0,))
        return
    # seeds outermost: a run stopped early still covers every case for its first seeds
    for seed, kind, sparsity, site, layer in product(SEEDS, TYPES, SPARSITY, SITES, LAYERS):
        yield kind, sparsity, site, layer, seed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "detect.csv"))
    ap.add_argument("--quick", action="store_true", help="a small subset (about 40 runs)")
    ap.add_argument("--resume", action="store_true", help="skip cases already in --out")
    ap.add_argument("--healthy-only", action="store_true")
    ap.add_argument("--healthy-sets", type=int, default=5)
    ap.add_argument("--shard", default="0/1", help="i/n: run every n-th case from the i-th "
                    "(run n processes with --threads 1 to use n cores)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--summarize", nargs="*", help="only print the summary of these CSVs")
    ap.add_argument("--done-from", nargs="*", default=[], help="also skip cases in these CSVs")
    ap.add_argument("--scope", choices=("batch", "sample"), default="batch",
                    help="fault statistics over the whole output tensor (default) or per "
                    "sequence (--scope sample: nothing depends on the batch)")
    ap.add_argument("--types", default=",".join(TYPES), help="fault types to run")
    args = ap.parse_args()
    if args.summarize:
        summarize(*args.summarize)
        return
    shard, shards = (int(v) for v in args.shard.split("/"))
    torch.set_num_threads(args.threads)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    done = set()
    for path in ([args.out] if args.resume else []) + args.done_from:
        if os.path.exists(path):
            with open(path) as fh:
                done |= {(r["kind"],
                          r.get("scope") or ("batch" if r["kind"] == "fault" else ""),
                          r["type"], r["sparsity"],
                          r["site"], r["layer"], r["seed"], r["dtype"])
                         for r in csv.DictReader(fh)}
    new_file = not (args.resume and os.path.exists(args.out))
    out = open(args.out, "w" if new_file else "a", newline="")
    writer = csv.DictWriter(out, fieldnames=FIELDS, extrasaction="ignore")
    if new_file:
        writer.writeheader()
    models = {}

    def model_for(dtype):
        if dtype not in models:
            models[dtype] = load(dtype)
        return models[dtype]

    calib = []
    for i, (dtype, prompt_set) in enumerate(product(("float32", "bfloat16"),
                                                    range(args.healthy_sets))):
        key = ("healthy", "", "", "", "", "", str(prompt_set), dtype)
        if key in done or i % shards != shard:
            continue
        model, tok = model_for(dtype)
        result, tmp, secs = run_case(model, prompt_ids(tok, 100 + prompt_set), [], prompt_set)
        calib.append((dtype, calibration_row(tmp)))
        shutil.rmtree(tmp, ignore_errors=True)
        row = dict(kind="healthy", seed=prompt_set, dtype=dtype, seconds=round(secs, 2),
                   **score_case(result, None))
        writer.writerow(row)
        out.flush()
        print(f"healthy {dtype} set {prompt_set}: {row['n_fault']} FAULT, "
              f"{row['n_suspect']} SUSPECT; {row['headline']}", flush=True)
    for dtype in ("float32", "bfloat16"):
        rows = [c for d, c in calib if d == dtype]
        if rows:
            print(f"healthy maxima {dtype}:", {k: round(max(c[k] for c in rows), 4)
                                               for k in rows[0]})
    if args.healthy_only:
        return
    model, tok = model_for("float32")
    types = args.types.split(",")
    todo = [c for c in cases(args.quick) if c[0] in types]
    for i, (kind, sparsity, site, layer, seed) in enumerate(todo):
        key = ("fault", args.scope, kind, str(sparsity), site, str(layer), str(seed), "float32")
        if key in done or i % shards != shard:
            continue
        spec = (f"{kind}@layer={layer},site={site},sparsity={sparsity},seed={seed},"
                f"scope={args.scope}")
        # block faults are looked for with the default block granularity; faults inside a
        # block with --granularity sublayer, as a user hunting an operator would run it
        granularity = "block" if site == "block" else "sublayer"
        result, tmp, secs = run_case(model, prompt_ids(tok, seed), [spec], seed, granularity)
        shutil.rmtree(tmp, ignore_errors=True)
        row = dict(kind="fault", scope=args.scope, type=kind, sparsity=sparsity, site=site,
                   layer=layer, seed=seed, dtype="float32", seconds=round(secs, 2),
                   **score_case(result, layer))
        writer.writerow(row)
        out.flush()
        print(f"{spec}: rank {row['rank']} ({row['verdict_at_fault']} "
              f"{row['diagnosis_at_fault']}) {secs:.1f}s", flush=True)
    out.close()
    summarize(args.out)


def summarize(*paths: str) -> None:
    import pandas as pd

    df = pd.concat([pd.read_csv(p) for p in paths], ignore_index=True)
    df["scope"] = df["scope"].fillna("batch") if "scope" in df else "batch"
    healthy = df[df["kind"] == "healthy"]
    for scope, faults in df[df["kind"] == "fault"].groupby("scope"):
        lines = [f"fault statistics scope = {scope}", "",
                 "| group | cases | top-1 | top-3 |", "|---|---|---|---|"]
        groups = [
            ("all faults", faults),
            ("dense (block output)",
             faults[(faults["sparsity"] == 1.0) & (faults["site"] == "block")]),
            ("dense (all sites)", faults[faults["sparsity"] == 1.0]),
            ("sparse 10% (all sites)", faults[faults["sparsity"] != 1.0]),
            ("sub-layer (mlp + attn)", faults[faults["site"] != "block"]),
        ]
        for col in ("type", "site", "sparsity", "layer"):
            groups += [(f"{col} = {value}", sub) for value, sub in faults.groupby(col)]
        groups += [(f"{kind}, sparsity {sparsity}", sub)
                   for (kind, sparsity), sub in faults.groupby(["type", "sparsity"])]
        lines += [f"| {name} | {len(sub)} | {sub['top1'].mean():.1%} | {sub['top3'].mean():.1%} |"
                  for name, sub in groups if len(sub)]
        print("\n".join(lines) + "\n")
        misses = faults[faults["top1"] == 0]
        if len(misses):
            print("misses by type/sparsity/site:")
            print(misses.groupby(["type", "sparsity", "site"]).size().to_string() + "\n")
    print(f"\nhealthy runs: {len(healthy)}, FAULT verdicts on them: "
          f"{int(healthy['n_fault'].sum())}, SUSPECT: {int(healthy['n_suspect'].sum())}")
    print(f"seconds per diagnosis (dump 2 prompts with sublayer probes + compare): median "
          f"{statistics.median(df['seconds']):.2f}, max {df['seconds'].max():.2f}")


if __name__ == "__main__":
    main()
