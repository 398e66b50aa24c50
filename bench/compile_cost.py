"""What capture costs a torch.compile'd model: the graph breaks at the hooks, and the probes.

    python bench/compile_cost.py [--model tiny|smollm2] [--backends eager,aot_eager,inductor]
                                 [--prompts 4] [--new-tokens 8]

Each configuration runs in a fresh process (its own dynamo caches): greedy ``generate`` of the
prompts with ``model.forward = torch.compile(model.forward, backend=B)``, twice. ``first`` is
the first pass (compilation, capture of every prompt: --samples = prompts), ``steady`` the
second pass (capture finished, its hooks removed, the compiled code as capture left it).
One torch thread (OMP_NUM_THREADS=1): on a shared machine more threads make the times swing
by 20x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run_one(model_name: str, backend: str, capture: str, prompts: int, new_tokens: int) -> dict:
    sys.path.insert(0, os.path.join(HERE, "..", "fixtures"))
    import torch

    torch.manual_seed(0)
    if model_name == "tiny":
        from tiny_models import build

        model = build("llama")
        vocab = 128
    else:
        from smollm2 import load

        model, vocab = load()[0], 49152
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randint(1, vocab, (1, 24 + 5 * i), generator=gen) for i in range(prompts)]
    if backend != "none":
        model.forward = torch.compile(model.forward, backend=backend)
    session = None
    if capture != "none":
        from srdd_dump import DumpConfig, register_hook

        session = register_hook(model, DumpConfig(
            dump_path=tempfile.mkdtemp(), samples=prompts, progress=False,
            probes="none" if capture == "clean" else DumpConfig().probes))

    def generate():
        with torch.no_grad():
            return [model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                   pad_token_id=0)[0].tolist() for ids in inputs]

    start = time.perf_counter()
    tokens = generate()
    first = time.perf_counter() - start
    start = time.perf_counter()
    generate()
    steady = time.perf_counter() - start
    if session is not None:
        session.close()
    from torch._dynamo.utils import counters

    return {"model": model_name, "backend": backend, "capture": capture, "first": first,
            "steady": steady, "graph_breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"],
            "captured": session is not None and session.path is not None,
            "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--backends", default="none,eager,aot_eager,inductor")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        backend, capture = args.one.split(":")
        print(json.dumps(run_one(args.model, backend, capture, args.prompts, args.new_tokens)))
        return
    rows = []
    for backend in args.backends.split(","):
        for capture in ("none", "clean", "probes"):
            out = subprocess.run(
                [sys.executable, __file__, "--model", args.model, "--prompts",
                 str(args.prompts), "--new-tokens", str(args.new_tokens), "--one",
                 f"{backend}:{capture}"], capture_output=True, text=True, check=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"})
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{r['model']:8} {backend:10} capture={capture:7} first {r['first']:7.2f} s  "
                  f"steady {r['steady']:6.2f} s  graph breaks {r['graph_breaks']:3}  graphs "
                  f"{r['graphs']:3}  same tokens {r['tokens'] == rows[0]['tokens']}",
                  flush=True)


if __name__ == "__main__":
    main()
