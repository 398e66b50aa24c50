"""Synthetic dump files for the compare tests, written with the real DumpWriter."""

from __future__ import annotations

import os

import h5py
import numpy as np

from srdd_dump.format import schema as s
from srdd_dump.format.writer import DumpWriter, Round, Tensor


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return s.float32_to_bf16_bits(np.asarray(x, dtype=np.float32))
    return np.asarray(x).astype(s.STORAGE_DTYPES[dtype])


def logical(x: np.ndarray, dtype: str) -> np.ndarray:
    """The values the reader gives back for ``x`` stored as ``dtype`` (after rounding)."""
    return s.decode(to_storage(x, dtype), dtype).astype(np.float64)


def write_dump(
    path: str,
    rounds: list[dict[int, np.ndarray]],
    dtype: str = "float32",
    names: list[str] | None = None,
    meta: dict | None = None,
    status: dict | None = None,
    token_ids: list[np.ndarray] | None = None,
) -> str:
    """One round per dict {layer: (batch, ntok, width) array}; round i is sample i, prefill;
    ``status``: what the capture reports at the end (the file's status); ``token_ids``: each
    round's (batch, ntok) input ids (default: all different)."""
    n_layers = max(k for r in rounds for k in r) + 1
    names = names or [f"model.layers.{i}" for i in range(n_layers)]
    writer = DumpWriter(path, meta or {"rank": 0, "pid": 1234}, names)
    for i, tensors in enumerate(rounds):
        batch, ntok, _ = next(iter(tensors.values())).shape
        writer.submit(
            Round(
                sample=i,
                step=0,
                batch=batch,
                seq=ntok,
                positions=np.arange(ntok),
                token_ids=np.arange(batch * ntok).reshape(batch, ntok) if token_ids is None
                else token_ids[i],
                tensors=[Tensor(k, to_storage(v, dtype), dtype) for k, v in tensors.items()],
            )
        )
    return writer.close(status)


def make_partial(final_path: str) -> str:
    """Turn a finished dump into what a crash leaves behind: ``*.h5.partial``, not complete."""
    partial = final_path + s.PARTIAL_SUFFIX
    os.replace(final_path, partial)
    with h5py.File(partial, "r+") as f:
        f.attrs[s.ATTR_COMPLETE] = 0
    return partial


def normal_rounds(rng: np.random.Generator, n_rounds=2, layers=(-1, 0, 1), shape=(2, 3, 16)):
    return [
        {layer: rng.standard_normal(shape).astype(np.float32) for layer in layers}
        for _ in range(n_rounds)
    ]


def compare_written(path: str, output: str | None = None, **kw):
    """``compare_path`` then, with ``output``, ``write_report``; the files in ``.written``."""
    from srdd_dump.compare import compare_path
    from srdd_dump.report import write_report

    if output is not None:
        from srdd_dump.report import report_format

        report_format(output)  # as the CLI: a bad format fails before any work
    result = compare_path(path, **kw)
    result.written = write_report(result, output) if output is not None else []
    return result


def baseline_written(mine: str, golden: str, output: str | None = None, thresholds=None, **kw):
    """``compare_baseline`` then, with ``output``, ``write_report``; the files in ``.written``."""
    from srdd_dump.compare import compare_baseline
    from srdd_dump.report import report_format, write_report

    if output is not None:
        report_format(output)
    result = compare_baseline(mine, golden, thresholds, **kw)
    result.written = write_report(result, output) if output is not None else []
    return result
