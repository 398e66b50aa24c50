"""Cost of the default probe scan on the real SmolLM2-135M, in forward-pass equivalents.

    python bench/scan_cost.py [--tokens 121] [--repeats 5] [--granularity block|sublayer]

Times, interleaved: a plain forward, a forward with capture only, and a forward with the default
scan (gain x2 sigmas x2 draws + dc + repeat x3, batched replays). The ideal cost of the scan is
one forward plus one layer evaluation per replay and layer: (1 + replays) forwards if the layers
were all of a forward's time, which is an upper bound of the ideal (embedding and lm_head are not
replayed).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures"))
from srdd_dump import DumpConfig, register_hook  # noqa: E402

from smollm2 import load  # noqa: E402


def timed(model, ids, config=None) -> tuple[float, str | None]:
    with torch.no_grad():
        if config is None:
            t = time.perf_counter()
            model(input_ids=ids)
            return time.perf_counter() - t, None
        session = register_hook(model, config)
        t = time.perf_counter()
        model(input_ids=ids)
        elapsed = time.perf_counter() - t
        session.close()
        return elapsed, session.path


def layer_only_time(model, ids, repeats: int) -> float:
    """Time of the 30 decoder layers alone within a forward (hooks on first/last layer)."""
    layers = model.model.layers
    marks = {}
    h1 = layers[0].register_forward_pre_hook(lambda *_: marks.__setitem__("a", time.perf_counter()))
    h2 = layers[-1].register_forward_hook(lambda *_: marks.__setitem__("b", time.perf_counter()))
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            model(input_ids=ids)
            times.append(marks["b"] - marks["a"])
    h1.remove()
    h2.remove()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=121)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--granularity", default="block")
    args = ap.parse_args()
    model, _ = load("float32")
    ids = torch.randint(0, 49152, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    plain, capture, scan = [], [], []
    size = 0
    with tempfile.TemporaryDirectory() as tmp:
        timed(model, ids)
        for _ in range(args.repeats):
            plain.append(timed(model, ids)[0])
            capture.append(timed(model, ids, DumpConfig(dump_path=tmp, probes="none"))[0])
            t, path = timed(model, ids, DumpConfig(dump_path=tmp, granularity=args.granularity))
            scan.append(t)
            size = os.path.getsize(path)
    layers_t = layer_only_time(model, ids, args.repeats)
    p, c, sc = (statistics.median(x) for x in (plain, capture, scan))
    cfg = DumpConfig()
    replays = 1 + len(cfg.sigmas) * cfg.draws + len(cfg.dc) + cfg.repeats
    ideal = p + replays * layers_t
    print(f"tokens {args.tokens}, granularity {args.granularity}, replays/layer {replays}")
    print(f"plain forward        {p * 1e3:8.1f} ms  (decoder layers alone {layers_t * 1e3:.1f} ms)")
    print(f"capture only         {c * 1e3:8.1f} ms  = {c / p:.2f} forwards")
    print(f"default scan         {sc * 1e3:8.1f} ms  = {sc / p:.2f} forwards")
    print(f"ideal scan           {ideal * 1e3:8.1f} ms  = {ideal / p:.2f} forwards "
          f"(forward + {replays} x layer time); scan / ideal = {sc / ideal:.2f}")
    est_first = 11 * 30 * p
    print(f"first SRDD estimate  {est_first:8.1f} s   (11 x 30 layers x plain forward) "
          f"= {est_first / sc:.0f}x the scan")
    print(f"dump size per sample {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
