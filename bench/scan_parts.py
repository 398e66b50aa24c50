"""Cost of the default scan by part, on the dense figure's work at 4 prompts (issue 29): the plain
generation, then the same generation captured with each part of the default alone or left out,
interleaved in one process (one torch thread, CPU time).

    python bench/scan_parts.py [ROUNDS]

Parts: the default; the prefill probed alone (``probe_steps=0``); decode step 1 alone; without
the float64 references (attention, mlp, norm); without scale and causal; no replay at all
(``probes=none``). Ratios are medians over ROUNDS (default 2) against the plain generation.
"""

from __future__ import annotations

import collections
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path[:0] = ["bench", "fixtures"]

from detect import prompt_ids  # noqa: E402
from moe_cost import generate  # noqa: E402

from srdd_dump import DumpConfig, register_hook  # noqa: E402

from smollm2 import load  # noqa: E402

PARTS = {
    "default": {},
    "prefill-only": {"probe_steps": "0"},
    "decode-only": {"probe_steps": "1"},
    "no float64 references": {"probes": "gain,dc,repeat,scale,causal"},
    "no replay": {"probes": "none"},
    "no scale, no causal": {"probes": "gain,dc,repeat,attention,mlp,norm"},
}


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    torch.set_num_threads(1)
    model, tokenizer = load("float32")
    ids = prompt_ids(tokenizer, 0, n=4)
    generate(model, ids[:1])  # warm-up

    def captured(**fields) -> None:
        folder = tempfile.mkdtemp(prefix="srdd-parts-")
        config = DumpConfig(dump_path=folder, samples=len(ids), progress=False, **fields)
        with register_hook(model, config):
            generate(model, ids)
        shutil.rmtree(folder)

    plain, parts = [], collections.defaultdict(list)
    for _ in range(rounds):
        t = time.process_time()
        generate(model, ids)
        plain.append(time.process_time() - t)
        for name, fields in PARTS.items():
            t = time.process_time()
            captured(**fields)
            parts[name].append(time.process_time() - t)
    p = statistics.median(plain)
    print(f"CPU time, 1 thread; 4 prompts; plain {p:.3f} s {[round(x, 2) for x in plain]}")
    for name, times in parts.items():
        print(f"{name}: {statistics.median(times) / p:.2f}x {[round(x, 2) for x in times]}")


if __name__ == "__main__":
    main()
