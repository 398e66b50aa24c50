"""The output folder's checks before a dump starts: a file in its place, and free space (msit
refuses to dump with less than 2 GB free)."""

from __future__ import annotations

import os
import shutil

from ..errors import UserError

GB = 1 << 30
MIN_FREE_GB = 2.0  # srdd-dump refuses to start with less free space (msit: 2 GB)
MIN_FREE_GB_ENV = "SRDD_DUMP_MIN_FREE_GB"  # sets the default of --min-free-gb


def refuse_a_file(path: str, named: str) -> None:
    """UserError when the output folder ``path`` is an existing file (``named``: how the user
    gave it, e.g. "-o out")."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{named}: a file of that name exists; name a folder")


def _existing(path: str) -> str:
    """``path``, or its nearest folder that exists."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return probe


def free_bytes(path: str) -> int | None:
    """Free space for an unprivileged user on the file system that holds (or will hold) path;
    None for a file system of no size (/proc, /sys: it holds no files, and creating the folder
    says why)."""
    usage = shutil.disk_usage(_existing(path))
    return usage.free if usage.total else None


def read_only(path: str) -> bool:
    """The file system that holds (or will hold) path is mounted read-only (it reports no free
    space: "only 0.00 GB free" would send the user to delete files)."""
    flags = getattr(os, "statvfs", None) and os.statvfs(_existing(path)).f_flag
    return bool(flags and flags & getattr(os, "ST_RDONLY", 1))


def check_free_space(path: str, min_free_gb: float) -> None:
    """Raise UserError when the file system of ``path`` has less than ``min_free_gb`` GB free
    (``min_free_gb`` <= 0: no check)."""
    if min_free_gb <= 0:
        return
    try:
        free = free_bytes(path)
        if read_only(path):
            raise UserError(f"-o {path}: its file system is read-only; choose another -o")
    except OSError as exc:
        raise UserError(f"-o {path}: cannot check the free space ({exc.strerror})") from None
    if free is not None and free < min_free_gb * GB:
        raise UserError(
            f"-o {path}: only {free / GB:.2f} GB free on its file system, {min_free_gb:g} GB "
            "required; free some space, choose another -o, or pass --min-free-gb 0 to skip "
            "this check"
        )
