"""Run the user's command with capture injected (``srdd-dump --exec``). No torch here."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from .config import ENV_CONFIG, ENV_STATUS_DIR, DumpConfig
from .errors import UserError

EXIT_CAPTURE_FAILED = 3

# Variables srdd-dump sets for the child (documented in docs/cli.md).
CHILD_ENV = (ENV_CONFIG, ENV_STATUS_DIR, "PYTHONPATH")


@dataclass
class ExecResult:
    returncode: int  # the command's own exit code
    files: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # why capture failed, one line each

    @property
    def exit_code(self) -> int:
        if self.returncode != 0:
            return self.returncode
        return EXIT_CAPTURE_FAILED if self.problems else 0


def split_command(command: str) -> list[str]:
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise UserError(f"cannot parse --exec {command!r}: {exc}") from None
    if not argv:
        raise UserError("--exec needs a command, e.g. --exec \"python infer.py\"")
    if shutil.which(argv[0]) is None:
        raise UserError(f"--exec: command not found: {argv[0]}")
    return argv


def child_env(config: DumpConfig, status_dir: str) -> dict[str, str]:
    from .capture.inject import SITE_DIR  # torch-free

    env = dict(os.environ)
    env[ENV_CONFIG] = config.to_json()
    env[ENV_STATUS_DIR] = status_dir
    parts = [SITE_DIR]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def run_exec(command: str, config: DumpConfig) -> ExecResult:
    """Run ``command`` (never through a shell), capturing in every Python process it starts."""
    argv = split_command(command)
    config.command = command
    os.makedirs(config.dump_path, exist_ok=True)
    status_dir = tempfile.mkdtemp(prefix="srdd-status-")
    try:
        proc = subprocess.Popen(argv, env=child_env(config, status_dir), shell=False)
        returncode = _wait_forwarding_signals(proc)
        return _collect(returncode, status_dir)
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)


def _wait_forwarding_signals(proc: subprocess.Popen) -> int:
    """Wait for the child; pass SIGINT/SIGTERM on so it can finish its dump file."""

    def forward(signum, frame):
        if signum == signal.SIGINT and _terminal_delivers_to_child():
            return  # Ctrl-C at a terminal already reached the child's process group
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _terminal_delivers_to_child() -> bool:
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def _collect(returncode: int, status_dir: str) -> ExecResult:
    result = ExecResult(returncode=returncode)
    statuses = []
    for name in sorted(os.listdir(status_dir)):
        try:
            with open(os.path.join(status_dir, name)) as fh:
                statuses.append(json.load(fh))
        except (OSError, ValueError):
            continue
    for st in statuses:
        if st.get("file"):
            result.files.append(st["file"])
        if st.get("error"):
            result.problems.append(f"pid {st['pid']}: capture failed: {st['error']}")
    if not result.files and not result.problems:
        reasons = [st["no_blocks"] for st in statuses if st.get("no_blocks")]
        if reasons:
            result.problems.append(reasons[0])
        elif not statuses:
            result.problems.append(
                "capture never started: no Python process of the command imported torch with "
                "srdd-dump loaded (is the command's python the one srdd-dump is installed in?)"
            )
        elif not any(st.get("model_seen") for st in statuses):
            result.problems.append("no model with a block stack ran a forward in any process")
        else:
            result.problems.append(
                "no model forward with more than one token was captured (no prefill seen)"
            )
    return result
