"""Shared helpers for the capture tests."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "fixtures")  # on pytest's pythonpath (pyproject.toml)


def run_cli(tool: str, *args: str, cwd: str | None = None, timeout: float = 600,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """Run srdd-dump / srdd-compare as a user would, with this interpreter."""
    module = {"srdd-dump": "srdd_dump.cli.dump", "srdd-compare": "srdd_dump.cli.compare"}[tool]
    full_env = dict(os.environ)
    full_env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + full_env.get("PATH", "")
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout, env=full_env,
    )


def run_plain(args: list[str], timeout: float = 600, attempts: int = 1,
              **kwargs) -> subprocess.CompletedProcess:
    """Run a program without capture (the reference a captured run is compared with); when it
    fails, the test fails naming the command, its exit code and the end of its stderr.

    ``attempts`` > 1 only for programs whose failure can come from the machine rather than the
    code (torchrun's rendezvous and gloo sockets on a loaded runner): a failed attempt is
    reported as a warning with its stderr, and the next one is run."""
    import warnings

    import pytest

    attempt = 1
    while True:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
        if proc.returncode == 0:
            return proc
        tail = "\n".join(proc.stderr.splitlines()[-40:])
        what = f"the plain run failed (exit code {proc.returncode}): {shlex.join(args)}\n{tail}"
        if attempt == attempts:
            pytest.fail(what, pytrace=False)
        warnings.warn(f"attempt {attempt} of {attempts}: {what}", stacklevel=2)
        attempt += 1


def py(script: str, *args: str) -> str:
    """An --exec command line running a fixture script with this interpreter."""
    import shlex

    return shlex.join([sys.executable, os.path.join(FIXTURES, script), *args])


def python_words(code: str, *args: str, timeout: float = 120) -> list[str]:
    """What ``python -c code args...`` prints, split into words (a fresh interpreter)."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, check=True).stdout.split()


def cpu_runs_float16() -> bool:
    """This torch computes float16 matmuls, softmax and norms on CPU (torch 2.1 does not: a
    float16 model fails there without capture too)."""
    import torch

    x = torch.ones(2, 2, dtype=torch.float16)
    try:
        torch.nn.functional.linear(x, x)
        torch.softmax(x, -1)
        torch.nn.functional.layer_norm(x, (2,))
    except RuntimeError:
        return False
    return True


def cpu_autocast_covers_attention() -> bool:
    """This torch's CPU autocast casts attention's inputs to one dtype (torch 2.1's does not:
    a Llama generation under bf16 autocast fails there without capture too)."""
    import torch

    q = torch.ones(1, 1, 2, 4)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.functional.scaled_dot_product_attention(q, q, q.to(torch.bfloat16))
    except RuntimeError:
        return False
    return True


def float16_on_cpu(value):
    """A float16 parameter of a test, skipped where this torch cannot run float16 on CPU."""
    import pytest

    return pytest.param(value, marks=pytest.mark.skipif(
        not cpu_runs_float16(), reason="this torch has no float16 kernels on CPU"))
