"""Readers shared by the tasks that run in one process (this one or a worker), and what reading
a damaged file can raise."""

from __future__ import annotations

from collections import OrderedDict

from ..format.reader import DumpError, DumpReader

# What a damaged dump file can raise while its data is read (after it opened and validated).
READ_ERRORS = (DumpError, OSError, KeyError, ValueError, RuntimeError)
# Readers kept open at once: tasks of one file reuse its reader; a folder of many rank files
# does not hold a file descriptor (two, with direct reads) per file.
MAX_OPEN = 32

_READERS: OrderedDict[str, DumpReader] = OrderedDict()


def open_reader(path: str) -> DumpReader:
    """A reader of ``path``, kept open for the later tasks of this process."""
    reader = _READERS.pop(path, None) or DumpReader(path)
    _READERS[path] = reader
    while len(_READERS) > MAX_OPEN:
        _READERS.popitem(last=False)[1].close()
    return reader


def close_readers() -> None:
    while _READERS:
        _READERS.popitem()[1].close()
