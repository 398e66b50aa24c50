"""Signals at a terminal (shared by the two commands' parent processes), and a closed stdout."""

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


def say(text: str) -> None:
    """Write ``text`` to stderr when the program has one: a program may run with it closed
    (``sys.stderr`` None under ``2>&-``, or a closed file), and capture never raises into
    it."""
    stream = sys.stderr
    if stream is None:
        return
    try:
        stream.write(text)
    except (OSError, ValueError, AttributeError):
        pass


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (OSError, ValueError, AttributeError):
        return False


class LazyBar:
    """A tqdm progress bar on stderr, made at its first update, only when stderr is a
    terminal (and ``enabled``)."""

    def __init__(self, total: int, desc: str, unit: str, enabled: bool = True):
        self.total, self.desc, self.unit, self.enabled = total, desc, unit, enabled
        self._bar = None

    def update(self, n: int = 1) -> None:
        if self._bar is None:
            if not (self.enabled and stderr_is_terminal()):
                return
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.desc, unit=self.unit, file=sys.stderr,
                             leave=False)
        self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def quiet_stdout() -> None:
    """Point stdout at the null device: its reader is gone (a closed pipe), and the exit's
    flush would fail again."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)
