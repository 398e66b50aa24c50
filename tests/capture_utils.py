"""Shared helpers for the capture tests."""

from __future__ import annotations

import os
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


def py(script: str, *args: str) -> str:
    """An --exec command line running a fixture script with this interpreter."""
    import shlex

    return shlex.join([sys.executable, os.path.join(FIXTURES, script), *args])


def python_words(code: str, *args: str, timeout: float = 120) -> list[str]:
    """What ``python -c code args...`` prints, split into words (a fresh interpreter)."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, check=True).stdout.split()
