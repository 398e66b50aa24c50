"""The watchdog's process handling (its stall and crash guards: test_fuzz.py)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LEAVE = """
import sys
from srdd_dump.runtime.watchdog import leave, supervise
def run():
    sys.stdout.write("child output")
    return 5
code = supervise(run, "srdd-compare")
sys.stdout.write(" watcher output, child code %d" % code)  # buffered: stdout is a pipe
leave(code)
"""


def test_leave_exits_with_the_code_and_keeps_buffered_output():
    proc = subprocess.run([sys.executable, "-c", LEAVE], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 5
    assert proc.stdout == "child output watcher output, child code 5"


def test_leave_without_a_watched_child_is_sys_exit():
    code = "from srdd_dump.runtime.watchdog import leave\nimport atexit\n" \
           "atexit.register(lambda: print('teardown ran'))\nleave(4)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 4
    assert proc.stdout.strip() == "teardown ran"


SUPERVISED = """
import os, signal, sys
from srdd_dump.runtime.watchdog import leave, supervise
def run():
    if sys.argv[1] == "interrupt":  # Ctrl-C before the command's own handler is in place
        os.kill(os.getpid(), signal.SIGINT)
    if sys.argv[1] == "killed":  # as the kernel's OOM killer ends a process
        os.kill(os.getpid(), signal.SIGKILL)
    return 0
leave(supervise(run, "srdd-compare"))
"""


def test_a_supervised_command_ends_in_one_line_however_it_ends():
    """Closed stdout and stderr (``>&-``), an interrupt during start-up and a kill from
    outside: an exit code and at most one line, never a traceback."""
    closed = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$0" ok >&- 2>&-',
                             SUPERVISED], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert closed.returncode == 0, closed.stderr
    interrupted = subprocess.run([sys.executable, "-c", SUPERVISED, "interrupt"],
                                 capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert (interrupted.returncode, interrupted.stderr) == (130, "srdd-compare: interrupted\n")
    killed = subprocess.run([sys.executable, "-c", SUPERVISED, "killed"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert killed.returncode == 137
    assert killed.stderr == "srdd-compare: error: killed (SIGKILL: out of memory?)\n"
