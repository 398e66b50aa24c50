"""One BLAS thread per compare process, through threadpoolctl (OpenBLAS, MKL, BLIS).

The compare kernels take their dot products from BLAS (``np.dot`` runs 2x faster than
``np.einsum`` here). OpenBLAS splits a dot product of more than 10,000 elements over every
core, so with ``-j N`` each of the N processes would start N threads that spin against each
other. The processes already divide the work, so each keeps one BLAS thread.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

_controller: Any = None  # threadpoolctl's ThreadpoolController; False: threadpoolctl missing
_loaded_at_one = False  # numpy's BLAS loaded at one thread (``one_blas_thread_from_load``)

# what OpenBLAS, MKL, BLIS, OpenMP and Accelerate read when they load
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                    "OMP_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def one_blas_thread_from_load() -> None:
    """For a command that only ever runs BLAS at one thread per process (srdd-compare):
    numpy imported now with its BLAS loaded at one thread; forked workers inherit it. Limiting
    a BLAS loaded with more is not enough: OpenBLAS's idle threads spin for about 0.1 s after
    they start, again in every forked worker, which took 0.2 s of the CPU of a 2-core compare.
    The environment is restored after: nothing the process runs later inherits the setting.
    With OpenBLAS ``one_blas_thread`` then has nothing to change, and skips threadpoolctl's
    search of the loaded libraries (30 ms). Nothing happens once numpy is imported. For an
    entry point only (cli/compare_command.py), never a library call."""
    global _loaded_at_one
    if "numpy" in sys.modules:
        return
    before = {name: os.environ.get(name) for name in THREAD_VARIABLES}
    os.environ.update(dict.fromkeys(THREAD_VARIABLES, "1"))
    try:
        import numpy

        _loaded_at_one = _openblas(numpy)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _openblas(numpy) -> bool:
    """numpy's BLAS is OpenBLAS (the wheels' own), which reads its thread count when it loads
    (with numpy); for any other (MKL may read it at its first call, or numpy has none)
    threadpoolctl finds and limits what is loaded."""
    try:
        name = numpy.__config__.CONFIG["Build Dependencies"]["blas"]["name"]
    except (AttributeError, KeyError, TypeError):  # numpy < 1.26
        return False
    return "openblas" in str(name).lower()


def _blas():
    """The BLAS libraries loaded in this process (found once: numpy loads its BLAS at import);
    None without threadpoolctl (an install without its dependencies: each BLAS keeps its own
    thread count, a matter of speed only)."""
    global _controller
    if _controller is None:
        import numpy  # noqa: F401 (numpy's own BLAS must be loaded to be found)

        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            _controller = False
        else:
            _controller = ThreadpoolController()
    return _controller.select(user_api="blas") if _controller else None


@contextlib.contextmanager
def one_blas_thread() -> Iterator[bool]:
    """Every loaded BLAS at one thread inside the block, the previous counts restored after it.
    Yields True when a BLAS library was found (and so is now single-threaded), or numpy's
    OpenBLAS was loaded at one thread."""
    if _loaded_at_one:
        yield True
        return
    blas = _blas()
    if blas is None or not blas.lib_controllers:
        yield False
        return
    with blas.limit(limits=1):
        yield True


def pin_blas_for_process() -> bool:
    """``one_blas_thread`` for the rest of a worker process's life."""
    if _loaded_at_one:
        return True
    blas = _blas()
    if blas is None:
        return False
    blas.limit(limits=1)
    return bool(blas.lib_controllers)
