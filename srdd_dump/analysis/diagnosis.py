"""Reference-free diagnosis: per-layer evidence -> score, verdict, labels. Pure numpy.

Two kinds of evidence (docs/method.md has the formulas and the calibration):

* **Exact evidence**: signals whose healthy value is known without any reference. On a healthy
  layer, repeat replays of the same input are identical (instability 0), floating-point outputs
  have no exact zeros, no channel is constant over tokens, the extreme value is attained once,
  and fp32 values use their low mantissa bits. Each has a fixed threshold set from healthy
  calibration runs with a wide margin; crossing it is a FAULT.
* **Relative evidence**: the mean offset of what a module adds to the residual stream (a bias
  fault shifts it; probes cannot see a constant) as a robust z-score against the other layers
  of the same kind in the same dump, with a threshold set at more than twice the largest
  healthy value. Gain and kurtosis change are reported but are not evidence: real models have
  natural outliers there (SmolLM2's gain is 20 at layer 0 and 3 at layer 11 against ~1.0
  elsewhere; its kurtosis falls by 10x at layer 9).

``score`` = the strongest evidence in units of its FAULT threshold: >= 1 is FAULT, >= 0.5 is
SUSPECT. A layer's score is the maximum over the block and its sub-layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..vocabulary import (
    ACTIVATION,
    BLOCK,
    CLIPPING,
    CORE,
    EXPERT,
    GRID_LEVELS,
    LINEAR,
    NORM,
    ROTARY,
    SUBLAYER,
    UNIT_ROUNDOFF,
    sublayer_kind,
)
from . import array_stats as st
from .identities import CLIP, OFFSET, OTHER, ZERO
from .signals import BLOCK_SITE, DECODE, LOW_BITS, PREFILL, Signals
from .tolerance import DEFAULT_LIMITS, tolerance_dtype
from .verdicts import FAULT, NORMAL, SUSPECT, VERDICT_ORDER

__all__ = ["FAULT", "NORMAL", "SUSPECT", "VERDICT_ORDER", "diagnose", "headline"]

SUSPECT_RATIO = 0.5

# Exact-evidence FAULT thresholds (calibration runs and margins: docs/method.md).
# fraction of exact zeros: bf16/fp16 sums cancel to exactly 0 now and then (healthy SmolLM2
# bf16 block outputs: up to 0.0011); fp32 ones essentially never.
ZERO_FRAC = {"float32": 1e-3, "float64": 1e-3, "float16": 5e-3, "bfloat16": 1e-2}
# fraction of non-zero elements that no perturbation moves (clipped). A block, attention or
# MLP output mixes many inputs, so in fp32 an element that stays bit-identical under the dc
# shift and every top-sigma gain draw does not occur (healthy max seen: 0); bf16/fp16 rounding
# can swallow a small response (healthy bf16 max seen: 0 with the all-probes rule).
FLAT_VALUE = {"float32": 1e-5, "float64": 1e-5, "float16": 5e-3, "bfloat16": 1e-2}
STUCK_FRAC = 1e-9  # any channel constant over all tokens of a sample; healthy max seen 0
# tokens at a channel's exact extreme: healthy max on 10 SmolLM2 runs 1 (fp32), 4 (bf16). The
# count alone grows with the tokens of a bf16/fp16 run (quantisation), so the evidence also needs
# the extreme to hold TIE_EXCESS times the count of the next values inward (signals.ties).
TIES = {"float32": 4, "float64": 4, "float16": 12, "bfloat16": 12}
TIE_EXCESS = 8.0  # healthy bf16 Gaussian channels: 2-3 from 10 to 16,000 tokens
INSTABILITY = {"float32": 1e-6, "float64": 1e-12, "float16": 1e-4, "bfloat16": 1e-3}
INSTABILITY_OVER_MEDIAN = 10.0  # a device-wide jitter floor is not a source
LOWBITS = 0.5  # values whose LOW_BITS[dtype] low mantissa bits are 0; healthy 2^-LOW_BITS
# rows of an output on an 8-bit grid (array_stats.grid_rows; healthy max seen 0): at this share
# the output was quantised to 8 bits and dequantised (QUANTIZED)
GRID_SHARE = 0.5
# A family at FAULT level on at least this share (and SYSTEMIC_MIN) of the layers of one site
# kind is one shared kernel, reported as SYSTEMIC_<FAMILY> rather than as many sources.
SYSTEMIC_SHARE = 0.5
# |x| whose square summed over a row of up to 65,536 channels overflows float32 (a norm's mean
# square of such a row is Inf: the row becomes zeros, or NaN); 7.2e16, while a model's healthy
# values stay many orders of magnitude below (SmolLM2's largest: ~100)
SQUARE_OVERFLOW = float(np.sqrt(np.finfo(np.float32).max / 65536))
NULL_Z = 3.0  # standard errors of a rate's lower bound (lower_bound)
# exact zeros of which fewer than this share stay 0 under the module's own replay are inherited
INHERITED = 0.1
SYSTEMIC_MIN = 3
# a shared family whose first FAULT layer holds this many times the later layers' evidence
# (their median), with none before it, was born at that layer and propagated: not systemic
PROP_RATIO = 10.0
ZEROS_EXPLAINED = 0.99  # host_zeros at or above: the zeros are the computation's
REFERENCE_FAMILIES = ("HOST_MISMATCH", "ATTENTION_MISMATCH", "MLP_MISMATCH")
# max |in-batch replay - clean output| / max |clean|: batched kernels round differently from
# batch 1 (healthy SmolLM2 fp32 max 1.2e-7, about 1 ulp of the largest value; bf16 0 on CPU).
# FAULT at about 80 fp32 ulps and 4 bf16 ulps of the largest value.
BATCH_DEP = {"float32": 1e-5, "float64": 1e-12, "float16": 4e-3, "bfloat16": 3e-2}
# the unit roundoff of the accumulation (float32 for the half types, as BLAS accumulates them)
ACCUMULATION_ROUNDOFF = {"float64": 2.0**-53}


def batch_dep_limit(dtype: str, width: int) -> float:
    """B(dtype), and at least K * u, the worst-case rounding of one dot product of length K
    (``width``: the model's hidden width, the length its projections sum over; 0 for none) in
    its accumulation type. A decode step's one-row call runs a matrix-vector product, its
    in-batch replay of several rows a matrix product, which sums in another order. Only
    float32 and float64 outputs can show it: a half-type output rounds it away."""
    return max(BATCH_DEP.get(dtype, 1e-5),
               width * ACCUMULATION_ROUNDOFF.get(dtype, 2.0**-24))
# the elements that moved sit at |clean| >= this x max |clean|, and are few: a clip limit
BATCH_DEP_EXTREME = 0.5
BATCH_DEP_FEW = 0.01

# Relative evidence, robust z among layers of the same kind. Mean offset of the update: the
# largest |z| on 10 healthy SmolLM2 runs (fp32 + bf16, 4 site kinds) was 5.6; FAULT at 12.
# Gain and kurtosis change are reported but not used as evidence: healthy SmolLM2 reaches
# |z| = 262 (gain, layer 0) and 1143 (kurtosis drop, layer 9) through natural structure.
Z_OFFSET = 12.0
RELATIVE_MIN_LAYERS = 8  # layers of a kind the relative z needs to reach FAULT
UNDER_FAULT = 1.0 - 1e-9  # the largest strength (score) of a SUSPECT

# Exact identities (docs/method.md): healthy value exactly 0 on every architecture and dtype
# measured; FAULT when the lower bound of the broken share reaches these.
SCALE_BROKEN = 1e-4  # elements of a linear operator breaking y(2^k x) = 2^k y(x)
CAUSAL_BROKEN = 1e-4  # elements before the cut moved by perturbing later tokens
SCALE_FAMILY = {ZERO: "DEAD_ZONE", CLIP: "SAT_SOURCE", OFFSET: "BIAS"}
JITTER_MARGIN = 10.0  # an identity break must exceed this x the module's repeat-run jitter
SCALE_WORDS = {
    ZERO: "values below a fixed limit flushed to 0",
    CLIP: "values clipped at a fixed limit",
    OFFSET: "a fixed offset added",
}
# Roles whose clean statistics are not evidence: a rotary embedding's cos/sin repeat by design,
# a ReLU-like activation has exact zeros and a clip as its healthy output.
NO_STATISTICS = (ROTARY, CLIPPING)
# Ties at a channel's extreme are healthy at an attention core (its rows are convex
# combinations of value rows: a head that puts all its weight on one token returns that token's
# values exactly; the same makes a core channel constant over the tokens) and at an activation
# (SiLU and GELU have a global minimum that many tokens reach in fp16/bf16).
NO_TIES = (CORE, ACTIVATION)
# Roles judged against the other layers (relative evidence): blocks and sub-blocks only; an
# operator's offset varies by design (biases), the identities and the host replay judge it.
RELATIVE_ROLES = ("", BLOCK, SUBLAYER)


@dataclass
class Evidence:
    family: str  # DEAD_ZONE, SAT_SOURCE, PILEUP_SAT, NOISE_SOURCE, SPIKE, BIAS, STUCK, ...
    strength: float  # value / FAULT threshold
    text: str
    exact: bool = True
    module: str = ""  # the module it was seen at, and the phase: the site row it belongs to
    phase: str = PREFILL
    secondary: bool = False  # listed after the other labels of its layer
    inheritable: bool = False  # exact, but the module's own replay moves it: from its input
    kind: str = ""  # the site kind of the module it comes from (block, mlp, mlp@decode...)


@dataclass
class LayerVerdict:
    layer: int
    module: str
    score: float
    verdict: str
    diagnosis: str
    evidence: list[Evidence] = field(default_factory=list)
    site: str = ""  # the module where the strongest evidence is
    systemic: tuple | None = None  # (family, site kind, layers with it, layers of the kind)

    def explain(self) -> str:
        items = sorted(self.evidence, key=lambda e: -e.strength)
        return "; ".join(f"{e.text} [{e.strength:.2g}x]" for e in items)


def robust_z(values: np.ndarray, floor: float = 1e-12) -> np.ndarray:
    """(v - median) / (1.4826 * max(MAD, 1% of |median|, floor)), NaN-safe."""
    v = np.asarray(values, dtype=np.float64)
    ok = np.isfinite(v)
    if ok.sum() < 3:
        return np.zeros_like(v)
    med = np.median(v[ok])
    mad = np.median(np.abs(v[ok] - med))
    scale = 1.4826 * max(mad, 0.01 * abs(med), floor)
    z = (v - med) / scale
    z[~ok] = 0.0
    return z


def _log(values: list[float]) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(v > 0, np.log(v), np.nan)


def _site_kind(sig: Signals) -> str:
    """block, self_attn, mlp, ...; decode steps are kinds of their own (``mlp@decode``)."""
    name = "block" if sig.site == BLOCK_SITE else sig.module.rsplit(".", 1)[-1]
    return name if sig.phase == PREFILL else f"{name}@{sig.phase}"


def lower_bound(rate: float, n: int, z: float = NULL_Z) -> float:
    """Wilson lower confidence bound of a rate seen on ``n`` values: the rate that a count of
    this size, on this many values, shows at least (z standard errors). Null model: each value
    is independently an exception (a zero, an unmoved value, a low-precision value) with the
    healthy probability; a fraction seen on few values (one decode token of a narrow model) is
    only evidence when it exceeds the limit by more than chance allows. n <= 0: the rate."""
    if not n or n <= 0 or not np.isfinite(rate):
        return rate
    z2 = z * z
    centre = rate + z2 / (2 * n)
    spread = z * math.sqrt(max(rate * (1 - rate), 0.0) / n + z2 / (4 * n * n))
    return max(0.0, (centre - spread) / (1 + z2 / n))


def _exact_evidence(sig: Signals, dtype: str, instab_median: float, compute_dtype: str = "",
                    input_zeros: float = 0.0, input_nonfinite: bool = False,
                    input_broken: bool = False, hidden: int = 0) -> list[Evidence]:
    """``input_zeros``: the exact-zero fraction of the module's input (the previous block's
    output), which inherited zeros need (NaN: its input is not in the dump);
    ``input_nonfinite``: that input held NaN/Inf already (an overflow born before it: this
    module's NaN/Inf are inherited, not its own); ``input_broken``: it held an Inf or values
    whose squares overflow float32 (nothing else of this module is judged)."""
    ev: list[Evidence] = []
    where = sig.module if sig.phase == PREFILL else f"{sig.module} ({sig.phase} steps)"
    stored = sig.dtype or dtype  # each module's own dtype (autocast, mixed precision)
    # rounding limits follow the precision the module computed in: under autocast an fp32
    # record holds sums of bf16 matmul results
    dtype = tolerance_dtype(stored, compute_dtype) if compute_dtype else stored
    if sig.nan_count or sig.inf_count:
        ev.append(Evidence("OVERFLOW", 1e3, f"{sig.nan_count} NaN, {sig.inf_count} Inf in {where}"
                           + (" (its input held NaN/Inf already)" if input_nonfinite else ""),
                           inheritable=input_nonfinite))
    if input_broken:
        # every statistic after an Inf or values past a norm's range is of a broken input (a
        # norm of such a row outputs zeros): nothing in it is this module's own
        return ev
    if not (sig.nan_count or sig.inf_count) and sig.absmax >= SQUARE_OVERFLOW:
        ev.append(Evidence("OVERFLOW", 1e3, f"values up to {sig.absmax:.3g} in {where}: their "
                           "squares summed over a row overflow float32 (a norm after it "
                           "outputs zeros or NaN)"))
    ev += _identity_evidence(sig, where, dtype)
    if sig.role in NO_STATISTICS:
        return ev
    # an output quantised to a grid of few levels (8 bits) and dequantised: its zeros (values
    # under half a step), the values a small shift leaves unmoved and the ties at the grid's
    # ends are the quantisation's, listed after it
    quantized = np.isfinite(sig.grid) and sig.grid >= GRID_SHARE
    zero_limit = ZERO_FRAC.get(dtype, 1e-3)
    zeros = lower_bound(sig.zero_frac, sig.n_values)
    if zeros > SUSPECT_RATIO * zero_limit:
        extra = f", dc response exactly 0 on {sig.dc_dead:.1%}" if sig.dc_dead > 0 else ""
        # the module's own replay moves its zeros (few stay 0 under every perturbation): they
        # came in with its input, from an earlier layer
        probed = bool(np.isfinite(sig.flat_zero))
        had = input_zeros >= 0.5 * sig.zero_frac  # its input held about as many already
        # an input of zeros only: no probe (each scaled by its row's std) could perturb it,
        # and a module without a bias maps it to zeros
        # nothing came in, nothing came out (a module with a bias, or a fault of its own, makes
        # something of zeros)
        blank = input_zeros >= 1.0 and sig.zero_frac >= 1.0 and not probed
        moved = had and (blank or (probed and sig.flat_zero < INHERITED * sig.zero_frac))
        # a normalisation or an activation maps an exact 0 of its input to 0: such zeros are
        # its input's, judged where they are made; in rounds no probe replayed (the samples
        # after --probe-samples), the zeros its input already had are taken as the input's
        passed_on = sig.role in (NORM, ACTIVATION) and (moved or (had and not probed))
        # an activation's or a norm's zeros that its float64 host replay makes too are the
        # computation's own (a saturated GELU tail, a norm channel whose weight is 0): not a
        # dead zone. Only there: a bf16 flush of values under the dtype's rounding of the row
        # elsewhere would pass as "explained"
        own = (sig.role in (NORM, ACTIVATION) and np.isfinite(sig.host_zeros)
               and sig.host_zeros >= ZEROS_EXPLAINED)
        if not passed_on and not own:
            dead = Evidence("DEAD_ZONE", zeros / zero_limit,
                            f"{sig.zero_frac:.2%} exact zeros in {where}{extra}",
                            inheritable=bool(moved), secondary=bool(quantized))
            if sig.role in (NORM, ACTIVATION) and not probed and not np.isfinite(input_zeros):
                # no probe and no input in the dump (an msprobe dump of the norms alone):
                # zeros the input passed on cannot be told from zeros made here
                dead.strength = min(dead.strength, UNDER_FAULT)
                dead.text += (" (no probe ran and its input is not in the dump: zeros its "
                              "input passed on would do this too)")
            ev.append(dead)
    flat_limit = FLAT_VALUE.get(dtype, 1e-3)
    flat = lower_bound(sig.flat_value, sig.n_probed)
    low = lower_bound(sig.lowbits, sig.n_values)
    coarse = stored in LOW_BITS and low > SUSPECT_RATIO * LOWBITS and stored == dtype
    ties = TIES.get(dtype, 4)
    excess = sig.tie_excess if np.isfinite(sig.tie_excess) else sig.ties
    piled = min(sig.ties / ties, excess / TIE_EXCESS) >= SUSPECT_RATIO
    # values on a coarser grid than their dtype's (an fp8 or bf16 round trip) do not move
    # under a shift smaller than the grid step, at the row's extremes too: that is the
    # PRECISION below, not a clip, unless the extremes also pile up
    if flat > SUSPECT_RATIO * flat_limit and (piled or not coarse) and not quantized:
        how = ("the output ignores its input: a constant" if _ignores_input(sig)
               else "clipped")
        ev.append(Evidence("SAT_SOURCE", flat / flat_limit,
                           f"{sig.flat_value:.2%} of non-zero elements in {where} do not move "
                           f"under a dc shift of the input ({how})"))
    if sig.stuck > STUCK_FRAC and sig.role != CORE:
        ev.append(Evidence("STUCK", 1.0 + 100 * sig.stuck,
                           f"{sig.stuck:.1%} of channels constant over every token in {where}"))
    strength = min(sig.ties / ties, excess / TIE_EXCESS)
    if strength >= SUSPECT_RATIO and sig.role not in NO_TIES:
        ev.append(Evidence("PILEUP_SAT", strength,
                           f"{sig.ties:.0f} tokens share a channel's exact extreme in {where}, "
                           f"{excess:.1f}x the count at the next values (pile-up "
                           f"{sig.pileup:.1f})", secondary=bool(quantized)))
    floor = INSTABILITY.get(dtype, 1e-6)
    limit = max(floor, INSTABILITY_OVER_MEDIAN * instab_median)
    if sig.instability > SUSPECT_RATIO * limit:
        family = "NOISE_SOURCE"
        if sig.instab_changed < 0.05 and sig.instab_kurtosis > 20:
            family = "SPIKE"
        ev.append(Evidence(family, sig.instability / limit,
                           f"repeat runs of {where} differ: rms {sig.instability:.2g} of the "
                           f"output, {sig.instab_changed:.1%} of elements changed"))
    # repeat runs that differ at all make the batched replay differ too: not a batch range
    noisy = sig.instability > SUSPECT_RATIO * floor
    batch_limit = batch_dep_limit(
        dtype, min(sig.width or hidden, hidden) if sig.phase == DECODE else 0)
    if not noisy and sig.batch_dep > SUSPECT_RATIO * batch_limit:
        # a module that is deterministic on its own but whose output for one input moves with
        # the other inputs of the batch: a range (max, scale) taken over the whole batch
        at_edge = (sig.batch_dep_level >= BATCH_DEP_EXTREME
                   and sig.batch_dep_moved < BATCH_DEP_FEW and not quantized)
        ev.append(_unless_unrepeated(sig, Evidence(
            "SAT_SOURCE" if at_edge else "BATCH_DEP", sig.batch_dep / batch_limit,
            f"the output of {where} for one input changes with the rest of its batch by "
            f"{sig.batch_dep:.2g} of max|x|"
            + (f", at its extremes ({_share(sig.batch_dep_moved)} of the elements, at "
               f"{sig.batch_dep_level:.2f} max|x|): a clip limit taken from the whole batch"
               if at_edge else ""), secondary=True)))
    if quantized:
        ev.append(Evidence("QUANTIZED", sig.grid / GRID_SHARE,
                           f"{sig.grid:.0%} of the rows of {where} lie on an even grid of at "
                           f"most {GRID_LEVELS} values (an 8-bit quantisation, dequantised)"))
    if coarse:
        ev.append(Evidence("PRECISION", low / LOWBITS,
                           f"{sig.lowbits:.0%} of the {stored} values in {where} have their "
                           f"{LOW_BITS[stored]} low mantissa bits 0 (a lower precision)"))
    # a reference says that the output is wrong, the module's own statistics say how (exact
    # zeros, a clip, noise...): with such a finding at FAULT level the mismatch is listed after
    if any(e.family not in REFERENCE_FAMILIES and e.strength >= 1 for e in ev):
        for e in ev:
            if e.family in REFERENCE_FAMILIES:
                e.secondary = True
    return ev


def _unless_unrepeated(sig: Signals, e: Evidence) -> Evidence:
    """Evidence that holds the module to bit equality (an identity, the batched replay), made
    SUSPECT at most when no repeat run measured whether the module is deterministic
    (--repeats 0): an output that varies from run to run breaks it too."""
    if not np.isfinite(sig.instability):
        e.strength = min(e.strength, UNDER_FAULT)
        e.text += " (no repeat runs were made: a non-deterministic output would do this too)"
    return e


def _identity_evidence(sig: Signals, where: str, dtype: str) -> list[Evidence]:
    """The exact identities and the float64 host replay of one module (``dtype``: the precision
    it computed in)."""
    ev: list[Evidence] = []
    # a module whose repeat runs already differ cannot be held to bit equality: an identity
    # breaks only by more than JITTER_MARGIN x that run-to-run jitter
    jitter = sig.instability if np.isfinite(sig.instability) else 0.0
    scale = lower_bound(sig.scale_broken, sig.scale_n) if sig.scale_n else 0.0
    if jitter > 0 and not sig.scale_size > JITTER_MARGIN * jitter:
        scale = 0.0
    if scale > SUSPECT_RATIO * SCALE_BROKEN and sig.role == EXPERT:
        pattern = sig.scale_pattern
        what = {OFFSET: " (a fixed offset added)", OTHER: " (values that vary by row)"}
        ev.append(Evidence(
            "BIAS" if pattern == OFFSET else "NOT_ZERO", scale / SCALE_BROKEN,
            f"zero input rows give non-zero output on {sig.scale_broken:.2%} of the elements "
            f"of {where}, a bias-free expert{what.get(pattern, '')}"))
    elif scale > SUSPECT_RATIO * SCALE_BROKEN:
        pattern = sig.scale_pattern
        ev.append(Evidence(
            SCALE_FAMILY.get(pattern, "NOT_LINEAR"), scale / SCALE_BROKEN,
            f"y(2^k x) != 2^k y(x) on {sig.scale_broken:.2%} of the elements of {where} "
            f"({SCALE_WORDS.get(pattern, 'a rounding or quantisation step with a fixed scale')})"))
    causal = lower_bound(sig.causal_broken, sig.causal_n) if sig.causal_n else 0.0
    # the causality copy is compared with the unperturbed copy of the same batched replay:
    # where that copy already differs from the module's own call (a row's last bits depend on
    # its place in the batch: a GEMM's tail tiles), a break must exceed that too
    placed = sig.batch_dep if np.isfinite(sig.batch_dep) else 0.0
    noise = max(jitter, placed)
    if noise > 0 and not sig.causal_size > JITTER_MARGIN * noise:
        causal = 0.0
    if causal > SUSPECT_RATIO * CAUSAL_BROKEN:
        ev.append(Evidence(
            "CAUSALITY", causal / CAUSAL_BROKEN,
            f"perturbing later tokens moved {sig.causal_broken:.2%} of the elements of earlier "
            f"rows of {where}"))
    ev = [_unless_unrepeated(sig, e) for e in ev]
    if np.isfinite(sig.host_red) or sig.host_red == float("inf"):
        limits = DEFAULT_LIMITS.get(dtype, DEFAULT_LIMITS["float32"])
        channel = sig.host_channel_red if np.isfinite(sig.host_channel_red) else 0.0
        red = max(sig.host_red, channel)
        strength = red / limits.rel_dist_fail
        if strength > SUSPECT_RATIO:
            what = ("" if sig.host_red >= channel else
                    f" in its worst channel ({sig.host_red:.3g} over the whole output)")
            kind = reference_kind(sig)
            reference = {
                "ATTENTION_MISMATCH": "srdd-dump's reference attention (its own "
                                      "scale, softmax, rotary, causal mask and head mapping)",
                "MLP_MISMATCH": "srdd-dump's reference MLP (its own activation)",
            }.get(kind, "its float64 host replay")
            ev.append(Evidence(
                kind, min(strength, 1e3),
                f"{where} differs from {reference} by {red:.3g}{what} "
                f"(relative distance; FAIL above {limits.rel_dist_fail:g} for {dtype})"))
    return ev


def _systemic_noise(group: list[Signals], dtype: str, compute_dtype: str = ""
                    ) -> list[Evidence] | None:
    """Repeat runs that differ beyond the dtype's floor at most layers of one site kind: the
    10x-median rule would hide them (the median is noisy too), so they are judged against
    the floor alone and reported as one shared kernel."""
    def floor(g: Signals) -> float:
        own = g.dtype or dtype
        return INSTABILITY.get(tolerance_dtype(own, compute_dtype) if compute_dtype else own, 1e-6)

    noisy = [g for g in group if g.instability > floor(g)]
    if len(noisy) < max(SYSTEMIC_MIN, SYSTEMIC_SHARE * len(group)):
        return None
    return [Evidence("NOISE_SOURCE", g.instability / floor(g),
                     f"repeat runs of {g.module} differ: rms {g.instability:.2g} of the output, "
                     f"{g.instab_changed:.1%} of elements changed") for g in group]


def relative_z(group: list[Signals]) -> dict[str, np.ndarray]:
    """Robust z of the offset, log gain and the drop of log kurtosis (vs the previous layer)
    among the layers of one site kind, in the order of ``group``."""
    kurt = _log([g.kurtosis + 3 for g in group])  # plain kurtosis > 0
    # offsets within the dtype's rounding of the values are the rounding's own (a normalised
    # output's mean is 0 up to it), and offsets within the chance mean of the values a round
    # averages are chance (one decode token of 576 channels: 0.04): their spread among layers
    # is no evidence
    rounding = max((UNIT_ROUNDOFF.get(g.dtype, 0.0) for g in group), default=0.0)
    noise = st.nanmedian([g.offset_noise for g in group])
    return {
        "offset": robust_z(np.array([g.offset for g in group], dtype=np.float64),
                           max(rounding, noise if np.isfinite(noise) else 0.0, 1e-12)),
        "gain": robust_z(_log([g.gain for g in group])),
        "kurt_drop": -robust_z(np.concatenate([[np.nan], np.diff(kurt)])),
    }


def _relative_evidence(group: list[Signals], whole: bool = True) -> dict[int, list[Evidence]]:
    """A layer's offset is evidence from the z of a FAULT only: a real model's layers are no
    sample of one distribution (healthy SmolLM2's late layers carry offsets the early layers'
    tight spread puts at z 6-6.6, half the FAULT's z). ``whole``: the group is the model's
    every layer; a part of them (``--layers``) is no sample of its layers at all: SUSPECT at
    most there."""
    out: dict[int, list[Evidence]] = {i: [] for i in range(len(group))}
    if any(g.role not in RELATIVE_ROLES for g in group) or (
            not whole and len(group) < RELATIVE_MIN_LAYERS):
        # a few layers picked from a model (--layers 'model.layers.1[0-2]'): a planted bias's
        # reaction in the next layer read z 32 among three, labelled the bias's source
        return out
    z = relative_z(group)
    # a median and MAD of a few layers cannot carry a z threshold: SUSPECT at most there
    cap = math.inf if len(group) >= RELATIVE_MIN_LAYERS and whole else UNDER_FAULT
    for i, g in enumerate(group):
        if z["offset"][i] >= Z_OFFSET:
            out[i].append(Evidence("BIAS", min(z["offset"][i] / Z_OFFSET, cap),
                                   f"mean offset of the update of {g.module or 'the block'} "
                                   f"{g.offset:.3g} "
                                   f"(z = {z['offset'][i]:.1f})", exact=False))
    return out


def site_groups(signals: list[Signals]) -> dict[str, list[Signals]]:
    """Signals grouped by site kind (block, self_attn, mlp, ...), each in layer order."""
    groups: dict[str, list[Signals]] = {}
    for sig in signals:
        groups.setdefault(_site_kind(sig), []).append(sig)
    for group in groups.values():
        group.sort(key=lambda g: g.layer)
    return groups


def diagnose(signals: list[Signals], dtype: str, n_layers: int, compute_dtype: str = "",
             whole: bool = True, after_gap: frozenset[int] = frozenset()
             ) -> list[LayerVerdict]:
    """One verdict per block layer 0..n_layers-1 from the block and sub-layer signals.

    ``dtype`` is the dump's hidden dtype, used for a module whose signals carry none;
    ``compute_dtype`` the autocast dtype the model ran under (limits follow the less precise).
    ``whole``: the dump holds every block of the model. The across-layer evidence (a layer's
    offset against the other layers') needs them: a part of the model (``--layers``) is no
    sample of its layers (neighbouring late layers share their offsets, so one of them stood
    out of ten at a healthy SmolLM2's layer 24, z 6.2), so there it is SUSPECT at most, from
    a FAULT's z."""
    evidence: dict[int, list[tuple[Evidence, str]]] = {k: [] for k in range(n_layers)}
    systemic: dict[str, tuple[str, int, int]] = {}  # family -> (site kind, layers, of)
    # exact zeros of each block's output (layer -1: the stack input, when it was read)
    block_zeros = {(g.layer, g.phase): g.zero_frac for g in signals if g.site == BLOCK_SITE}
    block_nonfinite = {(g.layer, g.phase) for g in signals
                       if g.site == BLOCK_SITE and (g.nan_count or g.inf_count)}
    # an Inf, or values whose squares overflow float32: a norm of such a row is zeros (a NaN
    # alone gives NaN, and leaves the module's other statistics its own)
    block_broken = {(g.layer, g.phase) for g in signals
                    if g.site == BLOCK_SITE and (g.inf_count or g.absmax >= SQUARE_OVERFLOW)}
    # an activation's input is a linear operator's output of its layer (gate_proj, c_fc, ...)
    linear_zeros: dict[tuple[int, str], float] = {}
    for g in signals:
        if g.role == LINEAR and np.isfinite(g.zero_frac):
            key = (g.layer, g.phase)
            linear_zeros[key] = max(linear_zeros.get(key, 0.0), g.zero_frac)
    # the blocks' width: the length the layers' projections sum over (a decode step's
    # batch-dependence limit); a site's own width may be a projection's output's
    hidden = max((g.width for g in signals if g.site == BLOCK_SITE), default=0)
    signals = [g for g in signals if g.layer >= 0]

    def input_nonfinite(sig: Signals) -> bool:
        """NaN/Inf reached the module from before it: in its input (the previous block's
        output), or for a decode step in the KV cache its prefill wrote from that input.
        (After a gap in the dump's blocks too: an earlier block's NaN reaches every later
        block through the residual stream.)"""
        return any((sig.layer - 1, phase) in block_nonfinite for phase in {sig.phase, PREFILL})

    def input_broken(sig: Signals) -> bool:
        """An Inf or values whose squares overflow float32 reached the module (as above)."""
        return any((sig.layer - 1, phase) in block_broken for phase in {sig.phase, PREFILL})

    def input_zeros(sig: Signals) -> float:
        """The exact zeros of the module's input; NaN when its input is not in the dump (after
        a gap in its blocks, ``after_gap``: the block before it is not its input)."""
        if sig.role == ACTIVATION:
            return linear_zeros.get((sig.layer, sig.phase), math.nan)
        if sig.layer in after_gap:
            return math.nan
        return block_zeros.get((sig.layer - 1, sig.phase), math.nan)

    # per phase, the first block whose output its input does not move (zeros, a constant), a
    # FAULT of its own: every later layer of that phase runs on what it made (the decode steps
    # on the prefill's too, through the KV cache), and its evidence is carried from it, but
    # zeros its input did not have
    dead_ends: dict[str, int] = {}
    for g in sorted(signals, key=lambda g: g.layer):
        if g.site == BLOCK_SITE and g.phase not in dead_ends and _ignores_input(g):
            own = _exact_evidence(g, dtype, 0.0, compute_dtype, input_zeros(g),
                                  input_nonfinite(g), input_broken(g), hidden)
            if any(e.strength >= 1 and not e.inheritable for e in own):
                dead_ends[g.phase] = g.layer

    def after_dead_end(sig: Signals) -> bool:
        ends = [dead_ends.get(PREFILL)] + ([dead_ends.get(sig.phase)]
                                           if sig.phase != PREFILL else [])
        return any(end is not None and sig.layer > end for end in ends)

    for kind, group in site_groups(signals).items():
        inst = np.array([g.instability for g in group], dtype=np.float64)
        inst = inst[np.isfinite(inst)]
        inst_median = float(np.median(inst)) if inst.size else 0.0
        relative = _relative_evidence(group, whole)
        per_layer = [_exact_evidence(sig, dtype, inst_median, compute_dtype, input_zeros(sig),
                                     input_nonfinite(sig), input_broken(sig), hidden)
                     + ([] if input_broken(sig) else relative[i])
                     for i, sig in enumerate(group)]
        for sig, items in zip(group, per_layer):
            if after_dead_end(sig):
                had = input_zeros(sig) >= 0.5 * sig.zero_frac
                for ev in items:
                    ev.inheritable = ev.inheritable or ev.family != "DEAD_ZONE" or had
        shared_noise = _systemic_noise(group, dtype, compute_dtype)
        if shared_noise is not None:
            for items, ev in zip(per_layer, shared_noise):
                items[:] = [e for e in items if e.family != "NOISE_SOURCE"]
                items.append(ev)
        for family, (count, of) in _shared_families(per_layer).items():
            # the same count at a block and inside it: the sub-layer is the narrower name
            # the same count at a block and inside it: the sub-layer is the narrower name;
            # in both phases: the prefill's
            def rank(kind_: str, count_: int) -> tuple:
                return count_, not kind_.startswith("block"), "@" not in kind_

            known = systemic.get(family, ("block", 0, 0))
            if rank(kind, count) > rank(known[0], known[1]):
                systemic[family] = (kind, count, of)
        for sig, items in zip(group, per_layer):
            for ev in items:
                ev.kind, ev.module, ev.phase = kind, sig.module, sig.phase
                evidence.setdefault(sig.layer, []).append((ev, sig.module))
    _propagated_families(evidence, systemic)
    verdicts = []
    for layer in range(n_layers):
        items = evidence.get(layer, [])
        score = max((e.strength for e, _ in items), default=0.0)
        verdict = FAULT if score >= 1 else SUSPECT if score >= SUSPECT_RATIO else NORMAL
        # equal evidence at a block, its sub-layer and an operator (the same tensor): the
        # narrowest module names it
        strong = sorted(items, key=lambda t: (-round(t[0].strength, 9), -t[1].count(".")))
        labelled = sorted(strong, key=lambda t: t[0].secondary)  # secondary families last
        labels = []
        for e, _ in labelled:
            if e.strength >= SUSPECT_RATIO and e.family not in labels:
                labels.append(e.family)
        site = _narrowest_source(labelled)
        verdicts.append(LayerVerdict(
            layer=layer, module="", score=float(score), verdict=verdict,
            diagnosis=",".join(labels), evidence=[e for e, _ in strong], site=site,
        ))
    _mark_propagation(verdicts, signals, min(dead_ends.values(), default=None))
    _mark_systemic(verdicts, systemic)
    return verdicts


def _ignores_input(sig: Signals) -> bool:
    """A block output that its input does not move: every non-zero element unmoved by the
    probes where a clip puts values (a constant output; healthy max 0). An output of zeros
    only is not one here: its later layers' zeros are judged by ``blank``."""
    return bool(np.isfinite(sig.flat_value) and sig.flat_value >= 0.99)


def _propagated_families(evidence: dict[int, list[tuple[Evidence, str]]],
                         systemic: dict[str, tuple[str, int, int]]) -> None:
    """A family shared by many layers is one kernel's only if it is independent at each: when
    no layer before its first FAULT layer shows it and that layer's evidence is PROP_RATIO x
    the later layers' (median), it was born there and carried on by the residual stream (a
    dead zone's exact zeros reach every later layer): not systemic, and the later layers'
    evidence of it is inherited (``_mark_propagation`` labels them ``<FAMILY>_PROP``)."""
    for family in list(systemic):
        strength: dict[int, float] = {}
        for layer, items in evidence.items():
            for e, _ in items:
                if e.family == family and e.strength >= SUSPECT_RATIO:
                    strength[layer] = max(strength.get(layer, 0.0), e.strength)
        faulty = sorted(k for k, v in strength.items() if v >= 1)
        if not faulty:
            continue
        first = faulty[0]
        later = [v for k, v in strength.items() if k > first]
        # a source needs clean layers before it: from layer 0 on it is one kernel's
        if first == 0 or any(k < first for k in strength) or not later or \
                strength[first] < PROP_RATIO * float(np.median(later)):
            continue
        del systemic[family]
        for layer, items in evidence.items():
            if layer > first:
                for e, _ in items:
                    if e.family == family:
                        e.inheritable = True


def _narrowest_source(items: list[tuple[Evidence, str]]) -> str:
    """The module a layer row names: among the modules with main evidence at the layer's
    level (FAULT, else SUSPECT), the innermost ones (a block or sub-block that contains another
    of them only carries its fault: its own replay runs the faulty operator inside), the
    strongest of those. ``items`` are (evidence, module), main findings first."""
    if not items:
        return ""
    main = [(e, m) for e, m in items if not e.secondary] or items
    for level in (1.0, SUSPECT_RATIO):
        found = {m for e, m in main if e.strength >= level}
        if found:
            break
    else:
        return items[0][1]
    inner = sorted(m for m in found if not any(o.startswith(m + ".") for o in found))
    strength = {m: max(e.strength for e, mm in main if mm == m) for m in inner}
    return max(inner, key=lambda m: (strength[m], m.count(".")))


def _shared_families(per_layer: list[list[Evidence]]) -> dict[str, tuple[int, int]]:
    """Families at FAULT level on at least SYSTEMIC_SHARE of one site kind's layers:
    family -> (layers with it, layers of the kind)."""
    counts: dict[str, int] = {}
    for items in per_layer:
        for family in {e.family for e in items
                       if e.strength >= 1 and not e.secondary and not e.inheritable}:
            counts[family] = counts.get(family, 0) + 1
    n = len(per_layer)
    return {f: (c, n) for f, c in counts.items()
            if c >= SYSTEMIC_MIN and c >= SYSTEMIC_SHARE * n}


def _mark_systemic(verdicts: list[LayerVerdict], systemic: dict[str, tuple[str, int, int]]
                   ) -> None:
    """Label the layers of a shared-kernel family ``SYSTEMIC_<FAMILY>`` (first label) and
    record the site kind and counts on each, for the headline."""
    for v in verdicts:
        families = v.diagnosis.split(",") if v.diagnosis else []
        # only a layer whose evidence of the family comes from the shared kind itself
        shared = [f for f in families if f in systemic and any(
            e.family == f and e.kind == systemic[f][0] and e.strength >= SUSPECT_RATIO
            for e in v.evidence)]
        if not shared:
            continue
        family = shared[0]
        kind, count, of = systemic[family]
        rest = [f for f in families if f != family]
        v.diagnosis = ",".join([f"SYSTEMIC_{family}"] + rest)
        v.systemic = (family, kind, count, of)


def _mark_propagation(verdicts: list[LayerVerdict], signals: list[Signals],
                      dead_end: int | None = None) -> None:
    """A layer after a FAULT source whose evidence of the source's families is all inherited,
    relative evidence (carried by the residual stream) or exact zeros that its own replay moves,
    is labelled ``<FAMILY>_PROP`` and is not a FAULT: one FAULT row per real source. So is a
    layer after ``dead_end`` (a block whose output its input does not move) whose evidence is
    all inherited, whatever its families: it runs on that block's constant."""
    sources: dict[str, float] = {}
    for v in verdicts:
        families = v.diagnosis.split(",") if v.diagnosis else []
        shown = [e for e in v.evidence if e.strength >= SUSPECT_RATIO]
        if dead_end is not None and v.layer > dead_end and families and shown and all(
                e.inheritable for e in shown):
            v.diagnosis = ",".join(f"{f.replace('_SOURCE', '')}_PROP" for f in families)
            if v.verdict == FAULT:
                v.verdict = SUSPECT
                v.score = min(v.score, UNDER_FAULT)
            continue
        inherited = [e for e in shown if (not e.exact and e.strength < sources.get(e.family, 0))
                     or e.inheritable]
        own = [e for e in shown if e not in inherited]
        if sources and families and inherited and not own and all(
                e.family in sources for e in inherited):
            v.diagnosis = ",".join(f"{f.replace('_SOURCE', '')}_PROP" for f in families)
            if v.verdict == FAULT:
                v.verdict = SUSPECT
                v.score = min(v.score, UNDER_FAULT)
            continue
        if v.verdict == FAULT:
            for f in families:
                sources.setdefault(f, v.score)


def _share(fraction: float) -> str:
    """A small share in words that never reads as none: '0.42%', '0.0031%'."""
    if fraction <= 0 or fraction >= 0.00995:
        return f"{fraction:.2%}"
    if fraction < 1e-6:
        return "under 0.0001%"
    return f"{100 * fraction:.2g}%"


def headline(v: LayerVerdict) -> str:
    """One sentence naming the layer, its verdict, what is wrong in plain words and the
    evidence with its strength, e.g. 'Layer 10 (model.layers.10.mlp): FAULT - dead zone (values
    flushed to exactly 0): 9.74% exact zeros in model.layers.10.mlp (97x the FAULT limit)'.
    The evidence quoted is the strongest of the layer's main finding (secondary findings, such
    as a batch dependence, follow it when they are stronger still). A shared kernel is named
    by its site kind: 'every mlp: FAULT - SYSTEMIC dead zone ... on 30/30 layers'."""
    if v.verdict == NORMAL or not v.evidence:
        return f"Layer {v.layer}: {v.verdict}"
    strongest = max(v.evidence, key=lambda e: e.strength)
    main = [e for e in v.evidence if not e.secondary]
    top = max(main, key=lambda e: e.strength) if main else strongest
    if v.systemic is not None:
        family, kind, count, of = v.systemic
        named = [e for e in v.evidence if e.family == family and e.kind == kind] or [top]
        top = max(named, key=lambda e: e.strength)
        what = FAMILY_WORDS.get(family, family.replace("_", " ").lower())
        kind = kind.replace("@", " (") + " steps)" if "@" in kind else kind
        return (f"every {kind} ({count}/{of} layers): {v.verdict} - SYSTEMIC {what}, one "
                f"shared kernel; strongest at layer {v.layer}: {top.text} "
                f"({top.strength:.3g}x the FAULT limit)")
    at_site = [e for e in main if e.module == v.site]
    if at_site:  # the evidence of the module the row names
        top = max(at_site, key=lambda e: e.strength)
    what = FAMILY_WORDS.get(top.family, top.family.replace("_", " ").lower())
    line = (f"Layer {v.layer} ({v.site or v.module}): {v.verdict} - {what}: {top.text} "
            f"({top.strength:.3g}x the FAULT limit)")
    if strongest is not top and strongest.strength > top.strength:
        # the main finding's own evidence under the limit: the stronger one is what makes
        # the verdict, and the line says so rather than quote an evidence below 1x first
        joint = ("; the verdict rests on" if top.strength < 1 <= strongest.strength
                 else "; also")
        line += f"{joint} {strongest.text} ({strongest.strength:.3g}x)"
    return line + _what_it_looks_like(top, [e for e in main if e is not strongest])


# a reference's mismatch says where a fault is, not what kind; these say what kind
REFERENCE_FAMILIES = ("MLP_MISMATCH", "ATTENTION_MISMATCH", "HOST_MISMATCH")
KIND_FAMILIES = ("DEAD_ZONE", "SAT_SOURCE", "PILEUP_SAT", "STUCK", "QUANTIZED", "PRECISION",
                 "OVERFLOW", "BIAS")


def _what_it_looks_like(top: Evidence, main: list[Evidence]) -> str:
    """'; what it looks like: saturation (...): EVIDENCE (Nx)' after a headline resting on a
    reference's mismatch, when the same module's output also shows a kind of fault at SUSPECT
    level or more: a clamp of an MLP's output is found by the reference MLP first, and its
    words ('a fault inside one of its operators') do not name the clamp."""
    if top.family not in REFERENCE_FAMILIES:
        return ""
    kinds = [e for e in main if e.family in KIND_FAMILIES and e.module == top.module
             and e.strength >= SUSPECT_RATIO]
    if not kinds:
        return ""
    kind = max(kinds, key=lambda e: e.strength)
    what = FAMILY_WORDS.get(kind.family, kind.family.replace("_", " ").lower())
    return f"; what it looks like: {what}: {kind.text} ({kind.strength:.3g}x)"


FAMILY_WORDS = {
    "DEAD_ZONE": "dead zone (values flushed to exactly 0)",
    "SAT_SOURCE": "saturation (values clipped at a limit)",
    "PILEUP_SAT": "saturation (values piled up at the extremes)",
    "NOISE_SOURCE": "non-deterministic output",
    "SPIKE": "non-deterministic spikes",
    "BIAS": "constant bias",
    "STUCK": "stuck channels",
    "PRECISION": "lost precision",
    "QUANTIZED": "quantised to 8 bits (values on an even grid of few levels)",
    "OVERFLOW": "NaN/Inf",
    "BATCH_DEP": "output depends on the rest of the batch",
    "NOT_LINEAR": "a linear operator is not scale-equivariant (quantised or rounded with a "
                  "fixed scale)",
    "CAUSALITY": "later tokens change earlier rows (an attention mask bug)",
    "HOST_MISMATCH": "output differs from a float64 replay of the same input",
    "ATTENTION_MISMATCH": "attention output differs from srdd-dump's reference attention of the "
                          "same input (its scale, softmax, rotary, mask or head mapping)",
    "MLP_MISMATCH": "MLP output differs from srdd-dump's reference MLP of the same input (a "
                    "fault inside one of its operators)",
}


def reference_kind(sig: Signals) -> str:
    """The evidence family of a module's host-record mismatch: an attention or MLP sub-layer's
    host record is srdd-dump's own reference computation (capture's attention_reference.py,
    mlp_reference.py), any other module's a float64 replay of its own code."""
    kind = sublayer_kind(sig.role, sig.module)
    return {"attention": "ATTENTION_MISMATCH", "mlp": "MLP_MISMATCH"}.get(kind, "HOST_MISMATCH")


def site_verdicts(verdicts: list[LayerVerdict]) -> dict[tuple[str, str], tuple[float, str, str]]:
    """(module, phase) -> (score, verdict, labels) from the evidence seen at that module: the
    drill-down from a layer row to its sub-layers and operators."""
    found: dict[tuple[str, str], list[Evidence]] = {}
    for v in verdicts:
        for e in v.evidence:
            found.setdefault((e.module, e.phase), []).append(e)
    out = {}
    for key, items in found.items():
        score = max(e.strength for e in items)
        labels = []
        for e in sorted(items, key=lambda e: -e.strength):
            if e.strength >= SUSPECT_RATIO and e.family not in labels:
                labels.append(e.family)
        verdict = FAULT if score >= 1 else SUSPECT if score >= SUSPECT_RATIO else NORMAL
        out[key] = (float(score), verdict, ",".join(labels))
    return out
