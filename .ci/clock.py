"""Say when a test suite starts and how long it took: `python .ci/clock.py start NAME` prints
the start (and the CI minute, from SRDD_CI_START) and the start's epoch seconds for the
recipe to keep; `python .ci/clock.py end NAME T0` prints the minutes since T0.

CI's log then shows where its 90 minutes went (the Makefile's ROOM_* minutes come from it)."""

import os
import sys
import time

what, name = sys.argv[1], sys.argv[2]
now = time.time()
if what == "start":
    start = os.environ.get("SRDD_CI_START")
    at = f" (CI minute {(now - float(start)) / 60:.0f})" if start else ""
    print(f"make: {name} starts at {time.strftime('%H:%M:%S', time.gmtime(now))} UTC{at}",
          file=sys.stderr)
    print(int(now))
else:
    print(f"make: {name} took {(now - float(sys.argv[3])) / 60:.1f} min")
