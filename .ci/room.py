"""Whether an extra test environment can run here: `python .ci/room.py VENV GB MINUTES`.

Exit 0 when the disk has room for it (VENV already installed, or GB free: the install's peak,
downloads and unpacked files, measured in docs/compatibility.md) and, under a CI deadline
(SRDD_CI_DEADLINE, seconds since the epoch, set by .ci/run), MINUTES are left for its install
and tests (measured on the slowest runner seen); else exit 1 after one line saying which tests
are skipped and why. A runner with a small disk or a slow CPU then still runs every test of
.venv (the main suite) and says what it could not run, instead of failing half-way."""

import os
import shutil
import sys
import time

venv, need_gb, need_min = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
deadline = float(os.environ.get("SRDD_CI_DEADLINE") or "inf")
left_min = (deadline - time.time()) / 60
why = None
if left_min < need_min:
    why = f"it takes about {need_min:g} min, {max(left_min, 0):.0f} min left of the CI's time"
elif not os.path.exists(os.path.join(venv, ".installed")):
    free_gb = shutil.disk_usage(os.path.dirname(os.path.abspath(venv))).free / (1 << 30)
    if free_gb < need_gb:
        why = f"installing it needs about {need_gb:g} GB of disk, {free_gb:.1f} GB free"
if why:
    print(f"make: SKIPPED the tests in {venv}: {why}", file=sys.stderr)
    sys.exit(1)
