"""One BLAS thread per compare process, through threadpoolctl (OpenBLAS, MKL, BLIS).

The compare kernels take their dot products from BLAS (``np.dot`` runs 2x faster than
``np.einsum`` here). OpenBLAS splits a dot product of more than 10,000 elements over every
core, so with ``-j N`` each of the N processes would start N threads that spin against each
other. The processes already divide the work, so each keeps one BLAS thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from threadpoolctl import ThreadpoolController

_controller: ThreadpoolController | None = None


def _blas():
    """The BLAS libraries loaded in this process (found once: numpy loads its BLAS at import)."""
    global _controller
    if _controller is None:
        import numpy  # noqa: F401 (numpy's own BLAS must be loaded to be found)

        _controller = ThreadpoolController()
    return _controller.select(user_api="blas")


@contextlib.contextmanager
def one_blas_thread() -> Iterator[bool]:
    """Every loaded BLAS at one thread inside the block, the previous counts restored after it.
    Yields True when a BLAS library was found (and so is now single-threaded)."""
    blas = _blas()
    if not blas.lib_controllers:
        yield False
        return
    with blas.limit(limits=1):
        yield True


def pin_blas_for_process() -> bool:
    """``one_blas_thread`` for the rest of a worker process's life."""
    blas = _blas()
    blas.limit(limits=1)
    return bool(blas.lib_controllers)
