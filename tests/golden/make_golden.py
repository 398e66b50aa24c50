"""Regenerate the golden dumps and reports: `python tests/golden/make_golden.py`.

The dumps are tiny Llama runs (three "cards" on the same prompts, the last with a planted dead
zone in layer 2's MLP), captured at sub-layer granularity with every probe. The reports are
what srdd-compare wrote for them when this file was last run; tests/test_golden.py checks that
the compare side still writes the same cells. Regenerate the reports only for an intended change
of report contents, and say so in the commit.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "fixtures"))

CARDS = os.path.join(HERE, "dumps", "cards")
REPORTS = os.path.join(HERE, "reports")
FAULT = "dead_zone@layer=2,m=0.3,sparsity=0.2,site=mlp"


def make_dumps() -> None:
    import torch

    from srdd_dump import DumpConfig, register_hook

    from tiny_models import build

    shutil.rmtree(CARDS, ignore_errors=True)
    os.makedirs(CARDS)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (1, n), generator=gen) for n in (11, 7)]
    for card, inject in (("card0", []), ("card1", []), ("card2", [FAULT])):
        model = build("llama", seed=0)
        with tempfile.TemporaryDirectory() as tmp:
            config = DumpConfig(dump_path=tmp, granularity="sublayer", inject=inject,
                                progress=False)
            with register_hook(model, config) as session, torch.no_grad():
                for ids in prompts:
                    model(ids)
            session.remove_faults()
            (found,) = [n for n in os.listdir(tmp) if n.endswith(".h5")]
            shutil.copy(os.path.join(tmp, found), os.path.join(CARDS, card + ".h5"))


def make_reports(out: str) -> None:
    from srdd_dump.compare import compare_baseline, compare_path
    from srdd_dump.report import write_report

    os.makedirs(out, exist_ok=True)
    write_report(compare_path(CARDS, progress=False), os.path.join(out, "free.csv"))
    write_report(compare_baseline(os.path.join(CARDS, "card2.h5"),
                                  os.path.join(CARDS, "card0.h5"), progress=False),
                 os.path.join(out, "baseline.csv"))


if __name__ == "__main__":
    if "--reports-only" not in sys.argv:
        make_dumps()
    shutil.rmtree(REPORTS, ignore_errors=True)
    make_reports(REPORTS)
    print("\n".join(sorted(os.listdir(REPORTS))))
