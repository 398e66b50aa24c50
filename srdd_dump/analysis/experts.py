"""Mixture of experts, from the records of a fused experts module's slots site: the routing and
each expert's own output rows (docs/method.md, "Experts")."""

from __future__ import annotations

import numpy as np


def split_route(route: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(index (T, k) int, weights (T, k), router margin (T,)) of a KIND_ROUTE record
    (..., 2k + 1); the margin is NaN where the router's logits were not seen."""
    flat = np.asarray(route, dtype=np.float64).reshape(-1, route.shape[-1])
    k = flat.shape[1] // 2
    index = np.where(np.isfinite(flat[:, :k]), flat[:, :k], -1).astype(np.int64)
    margin = flat[:, 2 * k] if flat.shape[1] > 2 * k else np.full(len(flat), np.nan)
    return index, flat[:, k:2 * k], margin


def expert_rows(slots: np.ndarray, index: np.ndarray, expert: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """(rows (T, H), routed (T,) bool): ``expert``'s output on the tokens routed to it (zeros
    elsewhere), from slot outputs (T, k * H) and their routing index (T, k)."""
    tokens, k = index.shape
    per_slot = np.asarray(slots).reshape(tokens, k, -1)
    hit = index == expert
    routed = hit.any(axis=1)
    slot = np.argmax(hit, axis=1)
    rows = per_slot[np.arange(tokens), slot]
    rows = np.where(routed[:, None], rows, 0)
    return rows, routed
