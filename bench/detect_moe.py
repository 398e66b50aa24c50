"""Detection benchmark for mixture-of-experts: plant a faulty expert (or router) in the
upcycled SmolLM2-MoE (SmolLM2-135M's weights in a Mixtral of E=4 experts, top-2, seeded random
router; fixtures/moe_models.py) while it generates, with default capture options, and check that
the reference-free diagnosis names the (layer, expert).

    python bench/detect_moe.py [--quick] [--out bench/results/detect_moe.csv] [--store stats]

Scoring as bench/detect.py: a hit is the planted layer as the top row **with verdict FAULT**
and, for an expert fault, that row's ``expert`` column the planted expert (``expert_hit``);
a router fault is a hit when the top row names the layer's router. Faults are the simulator's
``site=expert:E``: the expert's own output corrupted on its routed tokens, before its routing
weight (a faulty expert kernel): a relative dead zone, a flush-to-zero and a clamp at absolute
limits (the Q-quantile of the expert's |y| on its first call, then fixed), a fixed offset,
noise, bf16 rounding; dense and on 10% of the channels; every decode step only for a few.
Healthy runs were not used to set any limit: other prompts, bf16, a left-padded batch.

Each case: 1 prompt (chosen by the seed), greedy generation of 8 new tokens; the experts run
transformers' eager loop (its default grouped_mm is 2x slower on this CPU).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "fixtures"))
sys.path.insert(0, HERE)

import detect  # noqa: E402
from _models import write_rows  # noqa: E402
from detect import prompt_ids, run  # noqa: E402

from moe_models import upcycle_smollm2  # noqa: E402

PLACES = ((3, 1), (22, 3))  # (layer, expert)
TYPES = (  # (case, simulator type and options)
    ("dead_zone", "dead_zone,m=0.3"),  # relative: |y| < 0.3 max|y| of the call
    ("flush", "dead_zone,quantile=0.05"),  # flush-to-zero below a fixed limit
    ("clamp", "saturation,quantile=0.98"),  # clamp at a fixed limit
    ("offset", "bias,quantile=0.5"),  # a fixed offset (the median |y|)
    ("noise", "noise,m=0.1"),
    ("precision", "precision,dtype=bfloat16"),
)
FIELDS = ["case", "group", "spec", "layer", "expert", "dtype", "hit", "expert_hit",
          "top_layer", "top_verdict", "top_site", "top_expert", "top_diagnosis",
          "verdict_at_fault", "n_fault", "n_suspect", "seconds", "headline"]


def spec_of(kind: str, layer: int, site: str, sparsity: float, extra: str = "") -> str:
    name, _, options = kind.partition(",")
    return (f"{name}@layer={layer},site={site},{options}"
            + (f",sparsity={sparsity}" if sparsity < 1 else "") + extra)


def cases(quick: bool):
    places = PLACES[:1] if quick else PLACES
    for n, (label, kind) in enumerate(TYPES):
        for sparsity in (1.0, 0.1):
            for layer, expert in places:
                group = f"{label} {'dense' if sparsity == 1 else '10% channels'}"
                yield dict(case=label, group=group, layer=layer, expert=expert, seed=n,
                           spec=spec_of(kind, layer, f"expert:{expert}", sparsity))
    for label, kind in TYPES[:3] if quick else TYPES[:5]:
        yield dict(case=label, group=f"{label} decode only", layer=14, expert=2, seed=7,
                   spec=spec_of(kind, 14, "expert:2", 1.0, ",phase=decode"))
    for layer in (5,) if quick else (5, 20):
        yield dict(case="router noise", group="router", layer=layer, expert=None, seed=3,
                   spec=f"noise@layer={layer},site=router,m=0.3")


def score(result, layer: int, expert: int | None) -> dict:
    t = result.layers
    top = t.iloc[0]
    at = t[t["layer"] == layer]
    top_expert = top.get("expert")
    top_expert = None if top_expert is None or top_expert != top_expert else int(top_expert)
    hit = int(int(top["layer"]) == layer and top["verdict"] == "FAULT")
    if expert is None:
        named = hit and str(top["site"]).endswith(".gate")
    else:
        named = hit and top_expert == expert
    return dict(hit=hit, expert_hit=int(bool(named)), top_layer=int(top["layer"]),
                top_verdict=top["verdict"], top_site=top["site"], top_expert=top_expert,
                top_diagnosis=top["diagnosis"],
                verdict_at_fault=at["verdict"].iloc[0] if len(at) else "",
                n_fault=int((t["verdict"] == "FAULT").sum()),
                n_suspect=int((t["verdict"] == "SUSPECT").sum()),
                headline=result.headlines[0] if result.headlines else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "detect_moe.csv"))
    parser.add_argument("--store")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--only", help="run only the cases whose group contains this text")
    parser.add_argument("--probe-samples", type=int,
                        help="probe this many samples of each case instead of the default")
    parser.add_argument("--probe-steps",
                        help="probe these steps of each case instead of the default")
    parser.add_argument("--healthy-only", action="store_true", help="only the healthy runs")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    detect.STORE, detect.PROBE_SAMPLES = args.store, args.probe_samples
    detect.PROBE_STEPS = args.probe_steps
    rows = []
    model, tokenizer = upcycle_smollm2(4, 2)
    model.config._experts_implementation = "eager"
    for case in [] if args.healthy_only else cases(args.quick):
        if args.only and args.only not in case["group"]:
            continue
        ids = prompt_ids(tokenizer, case["seed"], n=1)
        result, seconds = run(model, ids, [case["spec"]], seed=case["seed"])
        row = dict(case, dtype="float32", seconds=round(seconds, 1),
                   **score(result, case["layer"], case["expert"]))
        rows.append(row)
        print(f"{row['group']:28s} {row['spec']:60s} hit={row['hit']} "
              f"expert={row['expert_hit']} top=L{row['top_layer']} {row['top_verdict']} "
              f"{row['top_site']} ({row['seconds']} s)", flush=True)
    healthy = [("other prompts", "float32", 11, False), ("left-padded batch", "float32", 12,
               True), ("bf16", "bfloat16", 13, False)]
    for label, dtype, prompt_set, pad in [] if args.only else healthy[:1] if args.quick \
            else healthy:
        m = model
        if dtype != "float32":
            m = upcycle_smollm2(4, 2, dtype=dtype)[0]
            m.config._experts_implementation = "eager"
        ids = prompt_ids(tokenizer, prompt_set, n=3 if pad else 2)
        result, seconds = run(m, ids, [], seed=prompt_set, pad=pad)
        t = result.layers
        row = dict(case="healthy", group=f"healthy {label}", spec="", layer=None, expert=None,
                   dtype=dtype, seconds=round(seconds, 1),
                   n_fault=int((t["verdict"] == "FAULT").sum()),
                   n_suspect=int((t["verdict"] == "SUSPECT").sum()),
                   top_verdict=t.iloc[0]["verdict"], top_site=t.iloc[0]["site"],
                   headline=result.headlines[0] if result.headlines else "")
        rows.append(row)
        print(f"{row['group']:28s} FAULT rows {row['n_fault']} SUSPECT rows {row['n_suspect']}",
              flush=True)
    write_rows(args.out, [{k: r.get(k, "") for k in FIELDS} for r in rows])
    faults = [r for r in rows if r["case"] != "healthy"]
    print(f"top-1 FAULT at the planted layer: {sum(r['hit'] for r in faults)}/{len(faults)}; "
          f"(layer, expert) named: {sum(r['expert_hit'] for r in faults)}/{len(faults)}")


if __name__ == "__main__":
    main()
