"""Size and cost of the stores on the real SmolLM2-135M (issue 17): bytes per sample of
``--store full``, the default ``sample:32768`` and ``stats``, at the chat prompts' natural
length and at about 500 and 2,000 tokens; the time the stats reductions take during capture
(the dump's ``stats_seconds``) against the whole capture.

    python bench/store_size.py [--out bench/results/store_size.csv] [--lengths 0,500,2000]
                               [--stores full,sample:32768,stats] [--repeats N]

Each run: SAMPLES prompts (all probed, as the default probes the first 4), greedy generation
of 8 new tokens, default capture options otherwise. Bytes per sample = file size / SAMPLES.
The full store is not run at 2,000 tokens (about 4.6 GB per sample).
"""

from __future__ import annotations

import argparse
import glob
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

from _models import write_rows  # noqa: E402
from detect import prompt_ids  # noqa: E402

from srdd_dump import DumpConfig, register_hook  # noqa: E402
from srdd_dump.format.reader import DumpReader  # noqa: E402

from smollm2 import load  # noqa: E402

SAMPLES = 2
STORES = ("full", "sample:32768", "stats")


def capture(model, ids, store: str) -> dict:
    tmp = tempfile.mkdtemp(prefix="srdd-size-")
    try:
        config = DumpConfig(dump_path=tmp, samples=len(ids), store=store, progress=False)
        start = time.perf_counter()
        with register_hook(model, config), torch.no_grad():
            for x in ids:
                model.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - start
        path = glob.glob(os.path.join(tmp, "*.h5"))[0]
        with DumpReader(path) as reader:
            status = reader.status
        return {"bytes": os.path.getsize(path), "seconds": round(seconds, 3),
                "stats_seconds": status.get("stats_seconds", "")}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results", "store_size.csv"))
    ap.add_argument("--lengths", default="0,500,2000", help="prompt tokens (0: natural)")
    ap.add_argument("--stores", default=",".join(STORES))
    ap.add_argument("--repeats", type=int, default=1, help="runs per store, interleaved")
    args = ap.parse_args()
    model, tokenizer = load("float32")
    rows = []
    for length in (int(v) for v in args.lengths.split(",")):
        ids = prompt_ids(tokenizer, 0, SAMPLES, tokens=length or None)
        tokens = sum(x.shape[1] for x in ids) / len(ids)
        capture(model, ids[:1], "stats")  # warm-up
        stores = [st for st in args.stores.split(",") if not (st == "full" and length > 500)]
        runs: dict[str, list[dict]] = {st: [] for st in stores}  # full: ~4.6 GB at 2,000
        for _ in range(args.repeats):  # interleaved: store A, store B, A, B, ...
            for store in stores:
                runs[store].append(capture(model, ids, store))
        for store in stores:
            got = runs[store]
            row = {"prompt_tokens": round(tokens), "store": store, "samples": SAMPLES,
                   "bytes_per_sample": got[0]["bytes"] // SAMPLES, "bytes": got[0]["bytes"],
                   "seconds": statistics.median(g["seconds"] for g in got),
                   "seconds_all": " ".join(str(g["seconds"]) for g in got),
                   "stats_seconds": statistics.median(g["stats_seconds"] for g in got)
                   if store == "stats" else "",
                   "stats_seconds_all": " ".join(str(g["stats_seconds"]) for g in got)}
            rows.append(row)
            print(row, flush=True)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
