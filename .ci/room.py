"""Whether the disk has room to install an extra test environment: `python .ci/room.py VENV GB`.

Exit 0 when VENV is already installed or its file system has GB free (the install's peak:
downloads and unpacked files, measured in docs/compatibility.md); else exit 1 after one line
saying which tests are skipped and why. A CI runner with a small disk then still runs every test
of .venv (the main suite) and says what it could not run, instead of failing in the middle of an
install."""

import os
import shutil
import sys

venv, need_gb = sys.argv[1], float(sys.argv[2])
if os.path.exists(os.path.join(venv, ".installed")):
    sys.exit(0)
free_gb = shutil.disk_usage(os.path.dirname(os.path.abspath(venv))).free / (1 << 30)
if free_gb >= need_gb:
    sys.exit(0)
print(f"make: SKIPPED the tests in {venv}: installing it needs about {need_gb:g} GB of disk, "
      f"{free_gb:.1f} GB free", file=sys.stderr)
sys.exit(1)
