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
