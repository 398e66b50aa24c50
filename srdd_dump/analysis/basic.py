"""Basic verdict rules for one layer's statistics (to be replaced by a real diagnosis).

Rules, first match wins:

1. any NaN or Inf value                  -> FAULT,   diagnosis ``NAN_INF``
2. no values at all                      -> SUSPECT, diagnosis ``NO_DATA``
3. every value exactly zero              -> FAULT,   diagnosis ``ALL_ZERO``
4. more than half the values exactly 0   -> SUSPECT, diagnosis ``MANY_ZEROS``
5. otherwise                             -> NORMAL,  empty diagnosis

Score: each verdict owns a band, so sorting by score alone also sorts FAULT > SUSPECT > NORMAL,
and within a band the score grows with how bad the layer looks:

* FAULT   in [200, 300]: 200 + 100 * fraction of non-finite values (ALL_ZERO scores 200)
* SUSPECT in [100, 200): 100 + 100 * zero fraction (NO_DATA scores 100)
* NORMAL  in [0, 100):   100 * zero fraction (at most 50)
"""

from __future__ import annotations

from .moments import Moments

FAULT = "FAULT"
SUSPECT = "SUSPECT"
NORMAL = "NORMAL"
VERDICT_ORDER = {FAULT: 0, SUSPECT: 1, NORMAL: 2}  # most suspicious first

NAN_INF = "NAN_INF"
NO_DATA = "NO_DATA"
ALL_ZERO = "ALL_ZERO"
MANY_ZEROS = "MANY_ZEROS"

MANY_ZEROS_FRAC = 0.5


def judge(stats: Moments) -> tuple[float, str, str]:
    """Return ``(score, verdict, diagnosis)`` for one layer; see the module docstring."""
    if stats.nonfinite:
        return 200.0 + 100.0 * stats.nonfinite / stats.total, FAULT, NAN_INF
    if stats.count == 0:
        return 100.0, SUSPECT, NO_DATA
    if stats.zeros == stats.count:
        return 200.0, FAULT, ALL_ZERO
    zero_frac = stats.zero_frac
    if zero_frac > MANY_ZEROS_FRAC:
        return 100.0 + 100.0 * zero_frac, SUSPECT, MANY_ZEROS
    return 100.0 * zero_frac, NORMAL, ""
