"""One BLAS thread per compare process.

The compare kernels take their dot products from BLAS (``np.dot`` runs 2x faster than
``np.einsum`` here). OpenBLAS splits a dot product of more than 10,000 elements over every
core, so with ``-j N`` each of the N processes would start N threads that spin against each
other. The processes already divide the work, so each keeps one BLAS thread. OpenBLAS reads its
thread count only from the environment at load time; afterwards only its C API changes it, which
is called here through ctypes on the copies of OpenBLAS this process has loaded (numpy's wheels
bundle one as ``libscipy_openblas64_``). Another BLAS, or no way to find it, is left alone and
the kernels keep ``np.einsum``.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Callable, Iterator

from .analysis import sums

_PREFIXES = ("scipy_openblas", "openblas")
_SUFFIXES = ("64_", "_64", "")


def _numpy_uses_openblas() -> bool:
    """numpy's own BLAS is OpenBLAS (another library may load one beside an MKL numpy)."""
    import numpy as np

    try:
        info = np.show_config(mode="dicts")
        return "openblas" in str(info["Build Dependencies"]["blas"]["name"]).lower()
    except Exception:  # noqa: BLE001 (numpy < 1.26 has no mode=, or another layout)
        return False


def _openblas_paths() -> list[str]:
    """Files of the OpenBLAS libraries mapped into this process (Linux)."""
    if not sys.platform.startswith("linux") or not _numpy_uses_openblas():
        return []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


_ThreadCountApi = tuple[Callable[[], int], Callable[[int], None]]


def _api(path: str) -> _ThreadCountApi | None:
    """(get, set) thread-count functions of one OpenBLAS, or None."""
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    except OSError:
        return None
    for prefix in _PREFIXES:
        for suffix in _SUFFIXES:
            get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
            put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
            if get is not None and put is not None:
                get.restype, get.argtypes = ctypes.c_int, []
                put.restype, put.argtypes = None, [ctypes.c_int]
                return get, put
    return None


_APIS: list[_ThreadCountApi] | None = None  # found once: the BLAS numpy loaded at import


def _apis() -> list[_ThreadCountApi]:
    global _APIS
    if _APIS is None:
        _APIS = [api for api in map(_api, _openblas_paths()) if api is not None]
    return _APIS


def set_blas_threads(count: int) -> list[int]:
    """Set every loaded OpenBLAS to ``count`` threads; returns the previous counts."""
    before = []
    for get, put in _apis():
        before.append(int(get()))
        put(int(count))
    return before


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """One BLAS thread inside the block, and the compare kernels' dot products through BLAS
    (``analysis.sums``); the caller's settings restored after it."""
    before, was = _pin()
    try:
        yield
    finally:
        sums.use_blas(was)
        for (_, put), count in zip(_apis(), before):
            put(count)


def pin_for_process() -> None:
    """``one_blas_thread`` for the rest of a worker process's life."""
    _pin()


def _pin() -> tuple[list[int], bool]:
    """One thread, dot products through BLAS if one was found; the previous counts and state."""
    return set_blas_threads(1), sums.use_blas(bool(_apis()))
