"""Report files written whole. A report's files are written into a folder beside it first and
moved into place when all are written, its other tables first and the main report last; an
earlier report's CSV tables this one has none of are then removed (beside this report they
would pass for this run's). A write that fails (a full disk) leaves the files already there as
they were, never a truncated one."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from typing import Callable

from ..errors import UserError


def place(output: str, write: Callable[[str], list[str]], stale: tuple[str, ...] = ()
          ) -> list[str]:
    """``write(path)`` the report into a staging folder as if at ``path``, then move its files
    beside ``output``; returns their paths there (the main report first). ``stale``: tables
    of an earlier report at ``output`` to remove when this one has none of them."""
    folder = os.path.dirname(os.path.abspath(output))
    try:
        os.makedirs(folder, exist_ok=True)
        stage = tempfile.mkdtemp(prefix=".srdd-report-", dir=folder)
    except OSError as exc:
        where = existing_part(folder)
        why = (f"{where} is a file, not a folder" if not os.path.isdir(where)
               else f"cannot make files in {where}: {exc.strerror or exc}")
        raise UserError(f"{output}: cannot write the report ({why})") from exc
    moved: list[str] = []
    try:
        staged = write(os.path.join(stage, os.path.basename(output)))
        written = [os.path.join(os.path.dirname(output), os.path.basename(p)) for p in staged]
        for target in written:  # refused before any file is replaced
            if os.path.isdir(target):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), target)
        for source, target in list(zip(staged, written))[::-1]:  # the main report last
            _move(source, target)
            moved.append(target)
        names = {os.path.basename(p) for p in written}
        for path in stale:
            if os.path.basename(path) not in names and os.path.isfile(path):
                os.remove(path)
    except OSError as exc:
        name = _user_name(exc, stage, output)
        done = (f"; {', '.join(moved)} already replaced" if moved
                else "; the files already there are as they were")
        raise UserError(f"{name}: cannot write the report ({exc.strerror or exc}){done}") \
            from exc
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return written


def _move(source: str, target: str) -> None:
    """Replace ``target`` whole; a link is written through (its target gets the report)."""
    if os.path.islink(target):
        shutil.copyfile(source, target)
    else:
        os.replace(source, target)


def _user_name(exc: OSError, stage: str, output: str) -> str:
    """The report file a write failed on, by the name the user gave (not the staged one)."""
    name = exc.filename2 or exc.filename
    if not isinstance(name, str):
        return output
    if os.path.dirname(os.path.abspath(name)) == stage:
        return os.path.join(os.path.dirname(output), os.path.basename(name))
    return output if os.path.abspath(name) == stage else name


def existing_part(folder: str) -> str:
    """The nearest part of ``folder`` that exists."""
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return folder
