"""Says when the package registry serves a library newer than the newest the capture is tested
with (srdd_dump/capture/versions.py): the range and pyproject.toml's dev extra should follow.
Informational: never fails the tests, and says nothing when the registry cannot be asked."""

import subprocess
import sys

from srdd_dump.capture.versions import TESTED, version_tuple

for name, (_, newest) in TESTED.items():
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        continue
    first = out.splitlines()[0] if out.strip() else ""
    served = first[first.find("(") + 1: first.find(")")] if "(" in first else ""
    if served and version_tuple(served) > version_tuple(newest):
        print(f"note: the registry serves {name} {served}, newer than the newest tested "
              f"({newest}): test it and raise the range in srdd_dump/capture/versions.py, "
              "pyproject.toml and the Makefile")
