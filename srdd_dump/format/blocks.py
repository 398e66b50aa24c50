"""A dump record in blocks of whole rows, so that any tensor is processed in constant memory.

Only the public ``DumpReader.read`` is used: a block is a copy of the record narrowed to some of
its rows (``row0``, ``nrows``) and presented as batch 1.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from . import schema as s
from .reader import DumpReader

BLOCK_ELEMENTS = 1 << 20  # about 4 MiB of float32 per block


def block_rows(width: int, elements: int | None = None) -> int:
    """Whole rows of ``width`` elements per block of about ``elements`` (BLOCK_ELEMENTS)."""
    return max(1, (elements or BLOCK_ELEMENTS) // max(1, int(width)))


def record_blocks(
    reader: DumpReader, record: np.void, rows: int | None = None
) -> Iterator[np.ndarray]:
    """The record's data as float arrays of shape (rows, width), in order."""
    total, width, row0 = int(record["nrows"]), int(record["width"]), int(record["row0"])
    step = rows or block_rows(width)
    if total <= step:  # one block: the record itself
        yield reader.read(record).reshape(total, width)
        return
    for start in range(0, total, step):
        part = np.array(record).copy()  # np.array(void) alone is a view into reader.records
        n = min(step, total - start)
        part["row0"] = row0 + start
        part["nrows"] = n
        part["batch"] = 1
        part["ntok"] = n
        yield reader.read(part).reshape(n, width)


def shape_of(record: np.void) -> tuple[int, int, int]:
    return int(record["batch"]), int(record["ntok"]), int(record["width"])


def first_rows(rounds: np.ndarray, table: np.ndarray, mask: np.ndarray, fields: tuple[str, ...]
               ) -> dict[tuple[int, ...], int]:
    """(the row's ``fields``) -> index of the first row of ``table`` (the records, or a stats
    index) under ``mask``. Rows of a round whose row of ``rounds`` (the file's /rounds) was
    never written (a crash) are left out, as in compare."""
    known = set(rounds["round"].tolist())
    out: dict[tuple[int, ...], int] = {}
    columns = [table[f] for f in fields]
    for i in np.flatnonzero(mask):
        key = tuple(int(c[i]) for c in columns)
        if key[0] in known:
            out.setdefault(key, int(i))
    return out


def clean_block_records(reader: DumpReader) -> dict[tuple[int, int], int]:
    """(round, layer) -> index into ``reader.records`` of every clean block-output record."""
    r = reader.records
    return first_rows(reader.rounds, r, (r["kind"] == s.KIND_CLEAN) & (r["site"] == s.BLOCK_SITE),
                      ("round", "layer"))


def clean_site_records(reader: DumpReader) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
    """((round, site) -> index into ``reader.records`` of every clean sub-layer or operator
    output record, site -> its layer)."""
    r = reader.records
    mask = (r["kind"] == s.KIND_CLEAN) & (r["site"] >= 0)
    layers = {int(site): int(layer) for site, layer in zip(r["site"][mask][::-1],
                                                            r["layer"][mask][::-1])}
    return first_rows(reader.rounds, r, mask, ("round", "site")), layers
