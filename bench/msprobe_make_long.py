"""A few-GB real msprobe dump for bench/msprobe_read.py: SmolLM2 fp32 forwards of long random
token sequences, one msprobe step each (task tensor, level L0, data_mode all, the decoder layer,
attention and MLP classes). Run it with a Python that has mindstudio-probe (see
fixtures/msprobe/make_fixtures.py for the side environment), from the repository root::

    /tmp/msprobe-venv/bin/python bench/msprobe_make_long.py /tmp/msprobe-long --steps 4 \\
        --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    a = ap.parse_args()
    sys.path[:0] = [ROOT, os.path.join(ROOT, "fixtures")]
    import torch
    from msprobe.pytorch import PrecisionDebugger

    from smollm2 import load

    model, _ = load("float32")
    config = {"task": "tensor", "dump_path": a.out, "rank": [], "step": [], "level": "L0",
              "async_dump": False,
              "tensor": {"scope": [], "list": ["LlamaDecoderLayer", "LlamaAttention", "LlamaMLP"],
                         "data_mode": ["all"]}}
    os.makedirs(a.out + ".cfg", exist_ok=True)
    with open(os.path.join(a.out + ".cfg", "config.json"), "w") as fh:
        json.dump(config, fh)
    debugger = PrecisionDebugger(config_path=os.path.join(a.out + ".cfg", "config.json"))
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(a.steps):
            ids = torch.randint(100, 40000, (1, a.tokens), generator=gen)
            debugger.start(model=model)
            model(ids)
            debugger.stop()
            debugger.step()
    print(f"{a.steps} steps of {a.tokens} tokens: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
