"""Readers shared by the tasks that run in one process (this one or a worker)."""

from __future__ import annotations

from ..format.reader import DumpReader

_READERS: dict[str, DumpReader] = {}


def open_reader(path: str) -> DumpReader:
    """A reader of ``path`` kept open for the later tasks of this process."""
    if path not in _READERS:
        _READERS[path] = DumpReader(path)
    return _READERS[path]


def close_readers() -> None:
    while _READERS:
        _READERS.popitem()[1].close()
