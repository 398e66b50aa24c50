"""Say when a test suite starts and how long it took: `python .ci/clock.py start|end NAME`.

CI's log then shows where its 90 minutes went (the Makefile's ROOM_* minutes come from it)."""

import os
import sys
import tempfile
import time

what, name = sys.argv[1], sys.argv[2]
mark = os.path.join(tempfile.gettempdir(), f"srdd-clock-{os.getuid()}-{name}")
now = time.time()
if what == "start":
    with open(mark, "w") as fh:
        fh.write(str(now))
    start = os.environ.get("SRDD_CI_START")
    at = f" (CI minute {(now - float(start)) / 60:.0f})" if start else ""
    print(f"make: {name} starts at {time.strftime('%H:%M:%S', time.gmtime(now))} UTC{at}")
else:
    try:
        with open(mark) as fh:
            began = float(fh.read())
    except (OSError, ValueError):
        sys.exit(0)
    os.remove(mark)
    print(f"make: {name} took {(now - began) / 60:.1f} min")
