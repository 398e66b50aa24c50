"""Float64 dot products and sums of whole blocks, through BLAS where that is safe.

``np.dot`` runs about 2x faster than ``np.einsum`` on a block of float64. But OpenBLAS splits a
dot product of more than 10,000 elements over every core, which crawls (up to 400x slower) when
the cores are busy. So BLAS is used only after ``use_blas(True)``, which the compare calls while
it holds this process's BLAS at one thread (``srdd_dump.runtime.blas``); otherwise ``dot`` uses
``np.einsum``. Either order of summation is accurate to a few float64 ulps per element summed.
"""

from __future__ import annotations

import numpy as np

try:  # einsum's C entry point: np.einsum adds about 4 us of dispatch per call (numpy 2)
    from numpy._core.multiarray import c_einsum as _einsum
except ImportError:  # numpy 1.x
    try:
        from numpy.core.multiarray import c_einsum as _einsum
    except ImportError:
        _einsum = np.einsum

_blas = False  # True while this process's BLAS runs one thread (set by the compare)


def use_blas(on: bool) -> bool:
    """Route ``dot`` through BLAS (``on``) or not; returns the previous state."""
    global _blas
    before, _blas = _blas, bool(on)
    return before


def dot(a: np.ndarray, b: np.ndarray) -> float:
    """sum(a * b) of two 1-D float64 arrays."""
    if _blas:
        return float(np.dot(a, b))
    return float(_einsum("i,i->", a, b))


def total(a: np.ndarray) -> float:
    """sum(a) of a 1-D float64 array (einsum's vectorised loop: 1.7x faster than the pairwise
    ``ndarray.sum`` and faster than a BLAS dot with ones)."""
    return float(_einsum("i->", a))
