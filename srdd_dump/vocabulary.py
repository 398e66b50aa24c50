"""The words and numbers both sides of a dump share: the site roles (the capture writes them in
a dump's ``site_roles``; discovery, hooks, host replay, faults and the diagnosis read them) and
the tuning constants of the statistics computed on both sides (capture/reductions.py in torch
for ``--store stats``, analysis/ in numpy). Defined once here: every package may import it."""

import math

import numpy as np

# -- site roles (docs/method.md says which probes and identities each gets) -----------------
BLOCK = "block"  # a block of the stack (its records have site -1)
SUBLAYER = "sublayer"  # an attention or MLP sub-block
LINEAR = "linear"  # nn.Linear and GPT-2's Conv1D: y(2^k x) = 2^k y(x), row by row
NORM = "norm"  # LayerNorm, RMSNorm, ...: row by row
ACTIVATION = "act"  # element-wise activation modules
CLIPPING = "act_clip"  # ReLU-like activations: exact zeros and a clip are their healthy output
CORE = "core"  # the attention core: the input of the attention's output projection
ROTARY = "rotary"  # the rotary position embedding (cos/sin), often one module for the model
# Mixture of experts (docs/method.md, "Experts"): the router's logits, the fused experts
# module's summed output, the routed experts' own outputs (one record per token slot: the
# "slots" site) and one virtual site per expert, whose rows are the tokens routed to it.
ROUTER = "router"
EXPERTS = "experts"
EXPERT_SLOTS = "expert_slots"
EXPERT = "expert"
ROW_WISE = (LINEAR, NORM, ACTIVATION, CLIPPING, ROUTER)  # each output row from its input row
# a block's sub-layers by their attribute name (capture's discovery, msprobe dumps' modules)
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
MLP_NAMES = ("mlp", "feed_forward", "ffn")


def sublayer_kind(role: str, name: str) -> str | None:
    """"attention" or "mlp" for a sub-layer site named so (its module path's last part), else
    None. (The upper-case strings of this module are the site roles.)"""
    if role != SUBLAYER:
        return None
    last = name.rsplit(".", 1)[-1]
    return "attention" if last in ATTENTION_NAMES else "mlp" if last in MLP_NAMES else None

# -- statistics constants ---------------------------------------------------------------------
# Masks of the low mantissa bits that a value of each dtype rarely has all zero, on the float32
# bits (analysis/signals.py explains the bit counts).
LOW_BITS_MASK = {"float32": 0x1FFF, "bfloat16": 0xF << 16, "float16": 0x7 << 13}
# above this share of values with their low mantissa bits 0, the share is taken over the
# distinct values: the copies of a clip limit (0.5, fp16's 65504: low bits 0 too) count
# once, a lower precision's values stay on its coarse grid however many there are. Above
# every dtype's healthy share (fp16's 2^-3: a healthy output never pays the sort) and below
# the share judged (analysis/diagnosis.py: SUSPECT_RATIO * LOWBITS = 0.25).
LOWBITS_BY_VALUE = 0.2
TIE_CANDIDATES = 8  # channels looked at for ties at their extreme
TIE_MIN_LEVELS = 16  # quantisation steps a channel must span before its extreme's ties count
CLIP_MIN_ROWS = 4  # distinct token rows before a channel's extreme can show a clip limit
CHANNEL_FLOOR = 0.1  # channels judged alone: rms at least this x the median channel's
PILEUP_BINS = 100  # histogram bins of the edge pile-up
# The 8-bit grid of a dequantised row (int8 or uint8 with a scale and zero point of its own):
# rows tested per record, the levels a grid may span, the non-zero values a row needs, and how
# far from a whole number of steps a value may be, plus its dtype's rounding (UNIT_ROUNDOFF)
GRID_ROWS = 8
GRID_LEVELS = 256
GRID_MIN_VALUES = 64
# bfloat16 rounds a value by up to half a step of an 8-bit grid at its top: a row of 64
# healthy bf16 values passes for a grid 1.4% of the time (widths of tiny models; none of 2,000
# in float16), a row of 96 to 128 about once in 20,000 (measured 2026-11-29, Gaussian rows)
GRID_MIN_VALUES_BF16 = 128
GRID_TOL = 1e-3
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11,
                 "float64": 2.0 ** -53}


def grid_row_picks(n: int) -> np.ndarray:
    """The rows of an n-row record the 8-bit grid test looks at: up to GRID_ROWS, evenly."""
    return np.unique(np.linspace(0, n - 1, min(n, GRID_ROWS)).astype(np.int64))


def grid_min_values(dtype: str) -> int:
    """The non-zero values a row of ``dtype`` needs before its grid is tested."""
    return GRID_MIN_VALUES_BF16 if dtype == "bfloat16" else GRID_MIN_VALUES


def on_grid(u: np.ndarray, eps: float) -> bool:
    """Sorted distinct values ``u`` are whole numbers of one step apart, within GRID_LEVELS
    steps and the rounding ``eps`` of their dtype. The step: the smallest gap of the small
    values (which the dtype resolves best), then span / n for every step count n that gap's
    own rounding allows. The step is coarser than the dtype's rounding at the largest value
    (any float row is a grid of its own finest spacing); whole numbers are an integer
    output's codes, not a dequantised one. (The numpy and the stats store's reductions both
    call it.)"""
    if u.size < 3 or u.size > GRID_LEVELS + 1 or np.all(u == np.rint(u)):
        return False
    top = max(abs(float(u[0])), abs(float(u[-1])))
    small = u[np.abs(u) <= top / 8]
    gap = float(np.diff(small if small.size >= 3 else u).min())
    span = float(u[-1] - u[0])
    if not gap > 0:
        return False
    slack = 2 * eps * top / 8 / gap  # the gap's relative rounding
    if slack >= 0.5:
        return False
    lo = max(1, math.floor(span / (gap * (1 + slack))))
    hi = min(GRID_LEVELS, math.ceil(span / (gap * (1 - slack))))
    for n in range(lo, hi + 1):
        step = span / n
        if step < 2 * eps * top:
            break
        k = (u - u[0]) / step
        tol = GRID_TOL + eps * (np.abs(u) + abs(float(u[0])) + 2 * top * k / n) / step
        if np.all(np.abs(k - np.rint(k)) <= tol):
            return True
    return False
DC_LOW = 0.15  # a dc response under this x the median response counts as low
# A channel constant over n distinct tokens is a stuck channel only when chance cannot make it
# one: a healthy channel that takes one value with probability p (an activation's floor in
# bf16: p up to STUCK_VALUE_SHARE) repeats it n times with probability p^(n-1), so n is taken
# large enough that a healthy output of W channels shows fewer than STUCK_BY_CHANCE of them.
STUCK_VALUE_SHARE = 0.5
STUCK_BY_CHANCE = 0.05


def stuck_min_tokens(width: int) -> int:
    """The distinct tokens a round needs before its constant channels count as stuck."""
    return max(4, 1 + math.ceil(math.log(max(width, 1) / STUCK_BY_CHANCE)
                                / -math.log(STUCK_VALUE_SHARE)))


# n tokens at a channel's exact extreme are a pile-up only when chance cannot put them there:
# near its extreme a healthy channel holds about lam values per quantisation level (the
# TIE_DENSITY_VALUES values next inward, over the levels they span), so n or more on the
# extreme itself has the Poisson tail probability P(X >= n; lam), and an output of W channels
# offers 2W extremes (each may be the one with the most ties): their chance of holding such a
# pile-up must reach TIES_BY_CHANCE. A bf16 channel whose values crowd a few levels near its
# top (healthy Gemma 3: 6 of 21 tokens on the top value, 5 on the 3 levels below) is not one.
TIE_DENSITY_VALUES = 4
TIES_BY_CHANCE = 0.05


def poisson_tail(n: int, lam: float) -> float:
    """P(X >= n) for X ~ Poisson(lam). The terms are summed from ``n`` away from the mode,
    where they fall, until they stop counting: a few hundred terms, not ``n``."""
    if n <= 0:
        return 1.0
    if lam <= 0:
        return 0.0
    log_lam = math.log(lam)

    def term(k: int) -> float:
        return math.exp(k * log_lam - lam - math.lgamma(k + 1))

    upward = n > lam
    total, k = 0.0, n if upward else n - 1
    while k >= 0:
        t = term(k)
        total += t
        if t <= total * 1e-17:
            break
        k += 1 if upward else -1
    return min(1.0, total) if upward else max(0.0, 1.0 - total)


def ties_by_chance(n: int, inward: int, levels: float, width: int) -> bool:
    """``n`` tokens at a channel's extreme, with ``inward`` values within ``levels``
    quantisation steps inward of it, are what chance gives one of the ``width`` channels of a
    healthy output (TIES_BY_CHANCE). No values inward: nothing to judge by, not chance."""
    if inward <= 0 or not levels > 0:
        return False
    lam = inward / max(1.0, levels)
    return 2 * width * poisson_tail(n, lam) >= TIES_BY_CHANCE


def span_levels(lowest: np.ndarray, top: np.ndarray, bottom: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """Each channel's span (top - bottom) in steps of its values' own precision, at its top and
    at its bottom: the float32 spacing at the extreme's magnitude times ``lowest``, the value of
    the lowest mantissa bit any of the channel's values uses (1 << 23 for none; bf16 values
    leave 16 bits 0). 0 for a channel without two finite values. The channel rule of a clip
    (array_stats.at_clip_limit, its torch twin in capture/reductions.py)."""
    with np.errstate(invalid="ignore", over="ignore"):
        span = np.abs(np.where(np.isfinite(top) & np.isfinite(bottom),
                               top.astype(np.float64) - bottom.astype(np.float64), 0.0))
        unit = lowest.astype(np.float64)  # a power of two
        out = []
        for ext in (top, bottom):
            step = np.spacing(np.abs(np.where(np.isfinite(ext), ext, 0.0)).astype(np.float32)
                              ).astype(np.float64) * unit
            out.append(np.where(step > 0, span / step, np.inf))
    return out[0], out[1]
