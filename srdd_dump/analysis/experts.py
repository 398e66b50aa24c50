"""Mixture of experts, from the records of a fused experts module's slots site: each expert's
own output rows, and the router's statistics (docs/method.md, "Experts")."""

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


def tokens_per_expert(index: np.ndarray, experts: int) -> np.ndarray:
    """(experts,) how many token slots went to each expert (indices out of range, an
    expert-parallel slot not on this rank, are not counted)."""
    flat = index.reshape(-1)
    flat = flat[(flat >= 0) & (flat < experts)]
    return np.bincount(flat, minlength=experts)


def topk_margin(logits: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Per token, the router's softmax probability of the least likely expert it was sent to
    minus that of the most likely one it was not: how close it came to another routing
    (negative when the router chose by another score, e.g. DeepSeek's corrected, grouped one)."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1, logits.shape[-1])
    x = x - x.max(axis=1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(axis=1, keepdims=True)
    chosen = np.zeros(p.shape, dtype=bool)
    rows = np.arange(len(p))[:, None]
    ok = (index >= 0) & (index < p.shape[1])
    chosen[np.broadcast_to(rows, index.shape)[ok], index[ok]] = True
    if chosen.all(axis=1).any():
        return np.full(len(p), np.nan)
    return np.where(chosen, p, 1.0).min(axis=1) - np.where(chosen, 0.0, p).max(axis=1)
