"""The verdict words of every report, defined once.

Reference-free diagnosis of a layer: FAULT, SUSPECT or NORMAL. GPU-baseline judgement of a
compared layer: PASS, WARN, FAIL, or N/A when it could not be compared.
"""

FAULT = "FAULT"
SUSPECT = "SUSPECT"
NORMAL = "NORMAL"
VERDICT_ORDER = {FAULT: 0, SUSPECT: 1, NORMAL: 2}  # most suspicious first

PASS = "PASS"
WARN = "WARN"
FAIL = "FAIL"
NOT_COMPARED = "N/A"
VERDICTS = (PASS, WARN, FAIL, NOT_COMPARED)
VERDICT_RANK = {PASS: 0, WARN: 1, FAIL: 2, NOT_COMPARED: -1}

# --fail-on: the worst verdicts that make the command exit 1, by level
FAIL_ON = {"fault": (FAULT,), "suspect": (FAULT, SUSPECT)}

# the baseline verdicts in the reference-free vocabulary, for --fail-on
AS_DIAGNOSIS = {FAIL: FAULT, WARN: SUSPECT, PASS: NORMAL, NOT_COMPARED: NORMAL}
