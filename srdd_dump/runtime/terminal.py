"""Signals at a terminal: shared by the two commands' parent processes."""

from __future__ import annotations

import os
import sys


def terminal_delivers_to_child() -> bool:
    """Ctrl-C at a terminal reaches every process of the foreground group, the child too: the
    parent must not forward it a second time."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False
