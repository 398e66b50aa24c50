"""The canary: the real SmolLM2, run by a script written the way users write it, through
``srdd-dump --exec`` with default options, must produce every default probe family: gain, dc
and repeat probes at prefill and at decode steps, on blocks, attentions and MLPs, and the
causality copy at prefill. A family with no record fails, whatever the capture said about it
(a library upgrade that turns a family off shows up here first)."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

from srdd_dump.format import schema
from srdd_dump.format.reader import DumpReader, find_dump_files

from capture_utils import FIXTURES, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.capture]

ATTENTION = ("self_attn", "attn", "attention", "self_attention")


@pytest.fixture(scope="module")
def default_dump(tmp_path_factory):
    from smollm2 import ensure_cache

    ensure_cache()
    tmp = tmp_path_factory.mktemp("canary")
    script = tmp / "infer.py"
    script.write_text(textwrap.dedent(f"""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        import sys
        import torch

        sys.path.insert(0, {FIXTURES!r})
        from smollm2 import chat_prompts, greedy_chat, load

        model, tokenizer = load()
        greedy_chat(model, tokenizer, chat_prompts(0, 4), new_tokens=8)
    """))
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp / "d"),
                  "--quiet")
    assert res.returncode == 0, res.stderr
    (path,) = find_dump_files(str(tmp / "d"))
    return path, res.stderr


def _level(name: str) -> str:
    last = name.rsplit(".", 1)[-1]
    return "attention" if last in ATTENTION else "MLP" if last == "mlp" else "other"


def test_every_default_probe_family_has_records(default_dump):
    path, stderr = default_dump
    assert "evidence missing" not in stderr, stderr
    with DumpReader(path) as r:
        rec, rounds = r.records, r.rounds
        step = rounds["step"][rec["round"]]
        levels = np.array(["block" if s == schema.BLOCK_SITE else _level(r.sites[s])
                           for s in rec["site"]])
        counts = {}
        for phase, in_phase in (("prefill", step == 0), ("decode", step > 0)):
            for level in ("block", "attention", "MLP"):
                for kind in (schema.KIND_GAIN, schema.KIND_DC, schema.KIND_REPEAT):
                    n = int((in_phase & (levels == level) & (rec["kind"] == kind)).sum())
                    counts[(phase, level, schema.KIND_NAMES[kind])] = n
            for level in ("block", "attention"):
                n = int((in_phase & (levels == level) & (rec["kind"] == schema.KIND_CAUSAL))
                        .sum())
                counts[(phase, level, "causal")] = n
        coverage = r.status["coverage"]
    wanted = [key for key in counts if not (key[0] == "decode" and key[2] == "causal")]
    missing = [key for key in wanted if counts[key] == 0]
    assert not missing, f"probe families with no record: {missing}"
    # the causality copy is a prefill probe: a decode step has no later token
    assert all(counts[("decode", level, "causal")] == 0 for level in ("block", "attention"))
    for family in ("prefill block probes", "decode block probes", "prefill attention probes",
                   "decode attention probes", "prefill MLP probes", "decode MLP probes"):
        assert coverage[family]["done"] == coverage[family]["expected"] > 0, family
