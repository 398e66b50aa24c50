"""Detection benchmark: plant device-like faults in the real SmolLM2-135M during generation and
check that the reference-free diagnosis names the faulty layer, with default capture options.
Uses only the public API (register_hook with ``DumpConfig(inject=...)``, then ``compare_path``);
the diagnosis never sees the fault.

    python bench/detect.py [--quick] [--out bench/results/detect.csv] [--resume]
    python bench/detect.py --shard 0/2 --threads 1 --out a.csv &   # two cores: two shards
    python bench/detect.py --shard 1/2 --threads 1 --out b.csv; wait
    python bench/detect.py --summarize a.csv b.csv [--plot docs/detection.png]

Honest scoring:
* a hit is the planted layer as the top row **with verdict FAULT** (a shared-kernel case: the top
  row's diagnosis ``SYSTEMIC_<FAMILY>``); SUSPECT at the planted layer is counted apart; FAULT
  rows on other layers are counted per case;
* faults are what devices make: element-wise absolute limits (a flush-to-zero below the
  Q-quantile of the site's |h|, a clamp above it, a fixed offset), per-sequence ranges, noise,
  on the block, attention or MLP output, inside operators (up_proj, v_proj, the activation),
  decode steps only, one kernel shared by every layer, and two faults at once; whole-tensor
  ranges are one more group; magnitudes swept from small to large;
* healthy runs are NOT the calibration runs: other prompts, lengths from 10 to 2,000 tokens,
  left-padded batches, bf16, fp16, fp32 under bf16 autocast, and tiny Qwen2 / GPT-2 / BERT.

Each case: 2 prompts (a prompt set chosen by the seed), greedy generation of 8 new tokens.
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

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "fixtures"))

from srdd_dump import DumpConfig, register_hook  # noqa: E402
from srdd_dump.compare import compare_path  # noqa: E402

from smollm2 import load  # noqa: E402

N_LAYERS = 30
LAYERS = (1, 10, 20, 28)
NEW_TOKENS = 8
FIELDS = [
    "kind", "group", "spec", "layer", "site", "type", "magnitude", "seed", "dtype", "hit",
    "suspect_at_fault", "top_layer", "top_verdict", "top_diagnosis", "verdict_at_fault",
    "n_fault", "n_fault_other", "n_suspect", "seconds", "top_site", "site_hit", "headline",
]


def prompt_ids(tokenizer, prompt_set: int, n: int = 2, tokens: int | None = None):
    with open(os.path.join(HERE, "..", "fixtures", "prompts.txt")) as fh:
        prompts = [line.strip() for line in fh if line.strip()]
    out = []
    for i in range(n):
        p = prompts[(prompt_set * n + i) % len(prompts)]
        if tokens:  # a long prompt: the text repeated to about that many tokens
            p = " ".join([p] * max(1, tokens // max(1, len(tokenizer(p).input_ids))))
        text = tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(tokenizer(text, return_tensors="pt").input_ids)
    return out


HUNT = dict(granularity="op", reference="host")  # the README's options for a hunt
STORE: str | None = None  # --store: the store every case dumps with (None: the default)
PROBE_SAMPLES: int | None = None  # --probe-samples: probed samples of every case (None: default)
PROBE_STEPS: str | None = None  # --probe-steps: probed steps of every case (None: the default)
TOKENS: int | None = None  # --tokens: the fault cases' prompts made about this long


def run(model, ids, inject=(), seed=0, pad=False, autocast=False, decoder=True, hunt=False):
    """Capture with default options (``hunt``: the hunt options) while the model generates;
    the compare result."""
    tmp = tempfile.mkdtemp(prefix="srdd-detect-")
    t = time.perf_counter()
    config = DumpConfig(dump_path=tmp, samples=len(ids), inject=list(inject), seed=seed,
                        progress=False, **(HUNT if hunt else {}),
                        **({"store": STORE} if STORE else {}),
                        **({"probe_samples": PROBE_SAMPLES} if PROBE_SAMPLES else {}),
                        **({"probe_steps": PROBE_STEPS} if PROBE_STEPS else {}))
    try:
        with register_hook(model, config), torch.no_grad(), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if pad == "right":  # one right-padded batch, a forward pass (no generation)
                width = max(x.shape[1] for x in ids)
                batch = torch.zeros(len(ids), width, dtype=torch.long)
                mask = torch.zeros_like(batch)
                for i, x in enumerate(ids):
                    batch[i, : x.shape[1]] = x[0]
                    mask[i, : x.shape[1]] = 1
                model(input_ids=batch, attention_mask=mask)
            elif pad:  # one left-padded batch of all the prompts
                width = max(x.shape[1] for x in ids)
                batch = torch.zeros(len(ids), width, dtype=torch.long)
                mask = torch.zeros_like(batch)
                for i, x in enumerate(ids):
                    batch[i, width - x.shape[1]:] = x[0]
                    mask[i, width - x.shape[1]:] = 1
                model.generate(batch, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                               do_sample=False, pad_token_id=0)
            else:
                for x in ids:
                    if decoder:
                        model.generate(x, max_new_tokens=NEW_TOKENS, do_sample=False,
                                       pad_token_id=0)
                    else:
                        model(input_ids=x)
        result = compare_path(tmp, progress=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result, time.perf_counter() - t


def score(result, layer, systemic: bool = False, site: str | None = None) -> dict:
    """``layer``: the planted layer, or a tuple of planted layers (two faults: a hit when the
    FAULT rows are exactly those layers)."""
    t = result.layers
    top = t.iloc[0]
    row = {
        "top_layer": int(top["layer"]), "top_verdict": top["verdict"],
        "top_diagnosis": top["diagnosis"], "n_fault": int((t["verdict"] == "FAULT").sum()),
        "top_site": top["site"],
        "n_suspect": int((t["verdict"] == "SUSPECT").sum()),
        "headline": result.headlines[0] if result.headlines else "",
    }
    if isinstance(layer, tuple):
        faulty = set(t.loc[t["verdict"] == "FAULT", "layer"].astype(int))
        row.update(hit=int(faulty == set(layer)), n_fault_other=len(faulty - set(layer)),
                   verdict_at_fault=",".join(
                       t.loc[t["layer"] == k, "verdict"].iloc[0] for k in layer))
    elif systemic:
        row["hit"] = int(top["verdict"] == "FAULT"
                         and str(top["diagnosis"]).startswith("SYSTEMIC_"))
        row["n_fault_other"] = 0
    elif layer is not None:
        at = t[t["layer"] == layer].iloc[0]
        row.update(
            hit=int(int(top["layer"]) == layer and top["verdict"] == "FAULT"),
            suspect_at_fault=int(at["verdict"] == "SUSPECT"), verdict_at_fault=at["verdict"],
            n_fault_other=int(((t["verdict"] == "FAULT") & (t["layer"] != layer)).sum()),
        )
        # the operator named: the top row's site is the planted module
        row["site_hit"] = int(bool(row["hit"]) and names_site(top["site"], site))
    return row


SITE_ALIASES = {"attn": ("self_attn", "attn", "attention", "self_attention"),
                "mlp": ("mlp", "feed_forward", "ffn")}


def names_site(top_site, site) -> bool:
    """The top row's site is the planted module (``site``: a path relative to the block, a
    full module path, or the simulator's attn/mlp aliases)."""
    top, site = str(top_site), str(site)
    return any(top == a or top.endswith("." + a) for a in SITE_ALIASES.get(site, (site,)))


# -- the cases ---------------------------------------------------------------------------------


def fault_cases(quick: bool):
    """(group, type, magnitude, specs, planted layer, site) for every fault case."""
    layers = (10, 28) if quick else LAYERS
    out = []
    # element-wise absolute limits (the default group): fraction of the site's values touched
    for site in ("mlp", "attn", "block"):
        for layer in layers:
            for q in (0.01, 0.1, 0.5):
                out.append(("absolute", "flush_to_zero", q,
                            [f"dead_zone@layer={layer},site={site},quantile={q}"], layer, site))
            for q in (0.999, 0.99, 0.9):
                out.append(("absolute", "clamp", round(1 - q, 4),
                            [f"saturation@layer={layer},site={site},quantile={q}"], layer, site))
            for q in (0.5,):
                out.append(("absolute", "offset", q,
                            [f"bias@layer={layer},site={site},quantile={q}"], layer, site))
    # below 0.1% of the values: where detection of absolute limits starts (MLP only)
    for layer in layers:
        for q in (0.0001, 0.001):
            out.append(("absolute", "flush_to_zero", q,
                        [f"dead_zone@layer={layer},site=mlp,quantile={q}"], layer, "mlp"))
        for q in (0.99999, 0.9999):
            out.append(("absolute", "clamp", round(1 - q, 6),
                        [f"saturation@layer={layer},site=mlp,quantile={q}"], layer, "mlp"))
    # inside operators
    for layer in layers:
        for site, kind, opt in (("mlp.up_proj", "flush_to_zero", "dead_zone@{},quantile=0.1"),
                                ("mlp.act_fn", "clamp", "saturation@{},quantile=0.99"),
                                ("self_attn.v_proj", "offset", "bias@{},quantile=0.5"),
                                ("mlp.up_proj", "precision", "precision@{},dtype=bfloat16")):
            spec = opt.format(f"layer={layer},site={site}")
            out.append(("operator", kind, float("nan"), [spec], layer, site))
    # per-sequence ranges and noise, magnitudes swept
    for site in ("mlp", "attn"):
        for layer in layers:
            for m in (0.01, 0.1, 0.3):
                out.append(("per-sequence", "dead_zone", m,
                            [f"dead_zone@layer={layer},site={site},m={m},scope=sample"], layer,
                            site))
                out.append(("per-sequence", "saturation", m,
                            [f"saturation@layer={layer},site={site},m={m},scope=sample"],
                            layer, site))
            for m in (0.001, 0.01, 0.1):
                out.append(("per-sequence", "noise", m,
                            [f"noise@layer={layer},site={site},m={m}"], layer, site))
    # decode steps only
    for layer in layers:
        for kind, spec in (("flush_to_zero", "dead_zone@{},quantile=0.1"),
                           ("clamp", "saturation@{},quantile=0.99"),
                           ("noise", "noise@{},m=0.01"), ("offset", "bias@{},quantile=0.5")):
            out.append(("decode-only", kind, float("nan"),
                        [spec.format(f"layer={layer},site=attn,phase=decode")], layer, "attn"))
    # one kernel shared by every layer
    for kind, spec in (("flush_to_zero", "dead_zone@{},quantile=0.1"),
                       ("clamp", "saturation@{},quantile=0.99"), ("noise", "noise@{},m=0.01")):
        specs = [spec.format(f"layer={k},site=mlp") for k in range(N_LAYERS)]
        out.append(("shared-kernel", kind, float("nan"), specs, None, "mlp"))
    # two faults at once: a hit when the FAULT rows are exactly the two planted layers
    for a, b in ((3, 20), (10, 25)):
        out.append(("two-faults", "flush+clamp", float("nan"),
                    [f"dead_zone@layer={a},site=mlp,quantile=0.1",
                     f"saturation@layer={b},site=attn,quantile=0.99"], (a, b), "mlp+attn"))
    # whole-tensor ranges (the former default simulator)
    for layer in layers:
        for kind in ("dead_zone", "saturation", "bias"):
            out.append(("whole-tensor", kind, 0.3,
                        [f"{kind}@layer={layer},site=mlp,m=0.3,scope=batch"], layer, "mlp"))
    return out


OPERATOR_SITES = ("mlp.act_fn", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.o_proj", "mlp.up_proj", "mlp.gate_proj", "mlp.down_proj",
                  "input_layernorm", "post_attention_layernorm")
OPERATOR_TYPES = (  # (type, spec template, magnitude)
    ("dead_zone", "mxfp4_deadzone@{},m=0.01", 0.01),
    ("flush_to_zero", "dead_zone@{},quantile=0.01", 0.01),
    ("clamp", "saturation@{},quantile=0.99", 0.01),
    ("offset", "bias@{},quantile=0.5", 0.5),
    ("precision", "precision@{},dtype=bfloat16", float("nan")),
    ("noise", "noise@{},m=0.01", 0.01),
)


def operator_cases(quick: bool):
    """The inner-operator matrix (run with the hunt options): every operator kind of a Llama
    block x six device fault types, dense at two layers and on 10% of the channels at one;
    magnitudes swept at up_proj; the model-level rotary table; an attention mask leak."""
    out = []
    layers = (20,) if quick else (5, 20)
    for layer in layers:
        for site in OPERATOR_SITES:
            for ftype, template, magnitude in OPERATOR_TYPES:
                for sparsity in (1.0, 0.1) if layer == 20 else (1.0,):
                    spec = template.format(f"layer={layer},site={site}")
                    if sparsity < 1:
                        spec += f",sparsity={sparsity}"
                    group = "operator" if sparsity == 1 else "operator-sparse"
                    out.append((group, ftype, magnitude, [spec], layer, site))
    for layer in layers[-1:]:  # magnitudes swept
        for q in (0.001, 0.1, 0.3):
            out.append(("operator-swept", "flush_to_zero", q,
                        [f"dead_zone@layer={layer},site=mlp.up_proj,quantile={q}"], layer,
                        "mlp.up_proj"))
        for q in (0.9, 0.999, 0.9999):
            out.append(("operator-swept", "clamp", round(1 - q, 6),
                        [f"saturation@layer={layer},site=mlp.up_proj,quantile={q}"], layer,
                        "mlp.up_proj"))
        for q in (0.01, 0.1):
            out.append(("operator-swept", "offset", q,
                        [f"bias@layer={layer},site=mlp.up_proj,quantile={q}"], layer,
                        "mlp.up_proj"))
        for m in (0.001, 0.1):
            out.append(("operator-swept", "noise", m,
                        [f"noise@layer={layer},site=mlp.up_proj,m={m}"], layer, "mlp.up_proj"))
    for dtype in ("bfloat16", "float16"):
        out.append(("operator", "precision", float("nan"),
                    [f"precision@layer=0,site=model.rotary_emb,dtype={dtype}"], 0,
                    "model.rotary_emb"))
    for m in (0.001, 0.01):
        out.append(("operator", "mask_leak", m, [f"causal_leak@layer=12,site=self_attn,m={m}"], 12,
                    "self_attn"))
    return out


def healthy_cases(quick: bool):
    """(name, dtype, runner kwargs) for the held-out healthy runs."""
    out = [("other prompts", "float32", dict(prompt_set=20 + k)) for k in range(2 if quick else 4)]
    out += [("bf16", "bfloat16", dict(prompt_set=30 + k)) for k in range(1 if quick else 2)]
    out += [("fp16", "float16", dict(prompt_set=40))]
    out += [("autocast bf16", "float32", dict(prompt_set=50, autocast=True))]
    out += [("left-padded batch", "float32", dict(prompt_set=60, pad=True))]
    out += [("left-padded batch bf16", "bfloat16", dict(prompt_set=61, pad=True))]
    out += [("right-padded batch, prefill", "float32", dict(prompt_set=62, pad="right", n=3))]
    out += [(f"{n} tokens", "float32", dict(prompt_set=70, tokens=n, n=1))
            for n in ((10, 2000) if quick else (10, 500, 2000))]
    out += [(f"tiny {arch}", arch, dict(prompt_set=80)) for arch in ("qwen2", "gpt2", "bert")]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "detect.csv"))
    ap.add_argument("--quick", action="store_true", help="a subset")
    ap.add_argument("--resume", action="store_true", help="skip cases already in --out")
    ap.add_argument("--shard", default="0/1", help="i/n: run every n-th case from the i-th")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--healthy-only", action="store_true")
    ap.add_argument("--faults-only", action="store_true")
    ap.add_argument("--operators", action="store_true",
                    help="the inner-operator matrix, and the healthy runs, with the hunt options")
    ap.add_argument("--only", help="run only the cases whose spec or name contains this")
    ap.add_argument("--store", help="dump with this --store (e.g. stats) instead of the default")
    ap.add_argument("--probe-samples", type=int,
                    help="probe this many samples of each case instead of the default")
    ap.add_argument("--probe-steps", help="probe these steps of each case instead of the default")
    ap.add_argument("--tokens", type=int,
                    help="the fault cases generate from one prompt of about this many tokens "
                         "(the text repeated) instead of two chat prompts")
    ap.add_argument("--summarize", nargs="*", help="only print the summary of these CSVs")
    ap.add_argument("--plot", help="with --summarize: a PNG of detection against magnitude")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize, args.plot)
        return
    global STORE, PROBE_SAMPLES, PROBE_STEPS, TOKENS
    STORE, PROBE_SAMPLES, TOKENS = args.store, args.probe_samples, args.tokens
    PROBE_STEPS = args.probe_steps
    shard, shards = (int(v) for v in args.shard.split("/"))
    torch.set_num_threads(args.threads)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    done = set()
    if args.resume and os.path.exists(args.out):
        with open(args.out) as fh:
            done = {(r["kind"], r["spec"], r["dtype"]) for r in csv.DictReader(fh)}
    new_file = not (args.resume and os.path.exists(args.out))
    out = open(args.out, "w" if new_file else "a", newline="")
    writer = csv.DictWriter(out, fieldnames=FIELDS, extrasaction="ignore")
    if new_file:
        writer.writeheader()
    models: dict = {}

    def model_for(name: str):
        if name not in models:
            if name in ("qwen2", "gpt2", "bert"):
                from tiny_models import build

                models[name] = (build(name), None)
            else:
                models[name] = load(name)
        return models[name]

    todo = []
    hunt = args.operators
    if not args.faults_only:
        todo += [("healthy", c) for c in healthy_cases(args.quick)]
    if not args.healthy_only:
        cases = operator_cases(args.quick) if hunt else fault_cases(args.quick)
        todo += [("fault", c) for c in cases]
    for i, (kind, case) in enumerate(todo):
        if i % shards != shard:
            continue
        if args.only and args.only not in str(case):
            continue
        if kind == "healthy":
            name, dtype, opts = case
            if ("healthy", name, dtype) in done:
                continue
            model, tok = model_for(dtype)
            opts = dict(opts)
            prompt_set, n, tokens = opts.pop("prompt_set"), opts.pop("n", 2), opts.pop("tokens",
                                                                                      None)
            if tok is None:  # a tiny random model: random token ids
                gen = torch.Generator().manual_seed(prompt_set)
                ids = [torch.randint(1, 128, (1, 20 + 7 * k), generator=gen) for k in range(2)]
            else:
                ids = prompt_ids(tok, prompt_set, n, tokens)
            result, secs = run(model, ids, seed=prompt_set, decoder=dtype != "bert", hunt=hunt,
                               **opts)
            row = dict(kind="healthy", group="healthy", spec=name, dtype=dtype,
                       seconds=round(secs, 1), **score(result, None))
            print(f"healthy {name} ({dtype}): {row['n_fault']} FAULT, {row['n_suspect']} "
                  f"SUSPECT; {row['headline'][:160]}", flush=True)
        else:
            group, ftype, magnitude, specs, layer, site = case
            spec = " + ".join(specs) if len(specs) <= 2 else f"{specs[0]} (x{len(specs)})"
            if ("fault", spec, "float32") in done:
                continue
            model, tok = model_for("float32")
            seed = i % 5
            result, secs = run(model, prompt_ids(tok, seed, n=1 if TOKENS else 2, tokens=TOKENS),
                               specs, seed=seed, hunt=hunt)
            row = dict(kind="fault", group=group, spec=spec,
                       layer="+".join(map(str, layer)) if isinstance(layer, tuple) else layer,
                       site=site,
                       type=ftype, magnitude=magnitude, seed=seed, dtype="float32",
                       seconds=round(secs, 1),
                       **score(result, layer, systemic=group == "shared-kernel", site=site))
            print(f"{spec}: hit {row['hit']}, top {row['top_layer']} {row['top_verdict']} "
                  f"{row['top_diagnosis']}, other FAULT {row['n_fault_other']} ({secs:.0f}s)",
                  flush=True)
        writer.writerow(row)
        out.flush()
    out.close()
    summarize([args.out], None)


def summarize(paths: list[str], plot: str | None) -> None:
    import pandas as pd

    df = pd.concat([pd.read_csv(p) for p in paths], ignore_index=True)
    faults = df[df["kind"] == "fault"].copy()
    healthy = df[df["kind"] == "healthy"]
    if "site_hit" in faults:  # recomputed from the rows: the rule may be newer than the CSV
        faults["site_hit"] = [int(h == 1 and names_site(t, s)) for h, t, s in
                              zip(faults["hit"], faults["top_site"], faults["site"])]
    ops = "site_hit" in faults and faults["site_hit"].notna().any()

    def named(sub) -> str:  # the top row's site is the planted operator
        return f" {sub['site_hit'].fillna(0).mean():.0%} |" if ops else ""

    head = " operator named (top row's site) |" if ops else ""
    lines = ["| group | type | cases | hit (top-1 FAULT) |" + head + " SUSPECT at the fault | "
             "cases with FAULT rows elsewhere |", "|---|---|---|---|---|---|" + ("---|" if ops
                                                                                else "")]
    for (group, ftype), sub in faults.groupby(["group", "type"], sort=False):
        lines.append(f"| {group} | {ftype} | {len(sub)} | {sub['hit'].mean():.0%} |{named(sub)} "
                     f"{sub['suspect_at_fault'].fillna(0).mean():.0%} | "
                     f"{(sub['n_fault_other'].fillna(0) > 0).mean():.0%} |")
    for group, sub in faults.groupby("group", sort=False):
        lines.append(f"| **{group}** | all | {len(sub)} | **{sub['hit'].mean():.0%}** |"
                     f"{named(sub)} {sub['suspect_at_fault'].fillna(0).mean():.0%} | "
                     f"{(sub['n_fault_other'].fillna(0) > 0).mean():.0%} |")
    if ops:
        for site, sub in faults.groupby("site", sort=False):
            lines.append(f"| by site | {site} | {len(sub)} | {sub['hit'].mean():.0%} |"
                         f"{named(sub)} | |")
    lines.append(f"| **all faults** | | {len(faults)} | **{faults['hit'].mean():.0%}** |"
                 + (f" **{faults['site_hit'].fillna(0).mean():.0%}** |" if ops else "")
                 + " | |")
    print("\n".join(lines) + "\n")
    if len(healthy):
        rows = len(healthy) * N_LAYERS
        print("| healthy run | dtype | FAULT rows | SUSPECT rows | headline |")
        print("|---|---|---|---|---|")
        for _, r in healthy.iterrows():
            print(f"| {r['spec']} | {r['dtype']} | {r['n_fault']} | {r['n_suspect']} | "
                  f"{str(r['headline'])[:90]} |")
        print(f"\nheld-out healthy runs: {len(healthy)}, FAULT rows {int(healthy['n_fault'].sum())}"
              f", SUSPECT rows {int(healthy['n_suspect'].sum())} (of about {rows})")
    misses = faults[faults["hit"] == 0]
    if len(misses):
        print("\nmisses:")
        for _, r in misses.iterrows():
            print(f"  {r['spec']}: top {r['top_layer']} {r['top_verdict']} {r['top_diagnosis']}")
    print(f"\nseconds per case (capture while generating + compare): median "
          f"{statistics.median(df['seconds']):.1f}, max {df['seconds'].max():.1f}")
    if plot:
        _plot(faults, plot)


def _plot(faults, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    swept = faults[faults["magnitude"].notna() & faults["group"].isin(
        ["absolute", "per-sequence"])]
    for (group, ftype), sub in swept.groupby(["group", "type"]):
        curve = sub.groupby("magnitude")["hit"].mean()
        ax.plot(curve.index, curve.values, marker="o", label=f"{group}: {ftype}")
    ax.set_xscale("log")
    ax.set_xlabel("magnitude (absolute: share of the site's values touched; per-sequence: m)")
    ax.set_ylabel("hit rate (top-1 FAULT)")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("SmolLM2-135M, default capture, generation")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
