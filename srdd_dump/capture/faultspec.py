"""Fault specs for the simulator (``--inject``): parsed without torch, applied by
``srdd_dump.capture.faults``. Syntax and fault types are documented there and in docs/cli.md."""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass, field

from ..errors import UserError
from .option_names import option

FAULT_TYPES = (
    "dead_zone", "mxfp4_deadzone", "saturation", "bias", "noise", "spike", "nondeterminism",
    "stuck_at", "bitflip", "precision", "causal_leak", "scale", "int8",
    # inside the attention kernel (capture/attention_faults.py)
    "softmax_precision", "double_scale", "rotary_offset", "mask_shift", "gqa_mapping",
)
ATTENTION_KERNEL = FAULT_TYPES[-5:]
# the key=value options a fault reads besides layer, site, m, sparsity and seed (faults.py,
# attention_faults.py): any other key is a typo that would otherwise be silently ignored
OPTION_KEYS = ("scope", "per", "phase", "rank", "limit", "quantile", "mode", "value", "rate",
               "bits", "dtype", "shift")
KEYS = ("layer", "site", "m", "sparsity", "seed", *OPTION_KEYS)
# the word-valued options, by fault type ("": any type that reads it): checked before the
# program runs (a bad word failed inside its first forward)
CHOICES = {
    "mode": {"nondeterminism": ("amplified", "inconsistent", "biased", "correlated"),
             "saturation": ("absolute", "relative"), "dead_zone": ("absolute", "relative"),
             "bias": ("absolute", "relative")},
    "bits": {"": ("mantissa", "exponent")},
    "dtype": {"": ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                   "float8_e5m2fnuz")},
}


@dataclass
class FaultSpec:
    type: str
    layer: int
    site: str = "block"
    m: float = 0.3
    sparsity: float = 1.0
    seed: int = 0
    options: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return asdict(self)


def parse_fault(text: str) -> FaultSpec:
    """Parse ``TYPE@layer=K,site=mlp,m=0.3,sparsity=0.1``."""
    where = f"{option('inject')} {text!r}"  # what an error names
    kind, _, rest = text.strip().partition("@")
    kind = kind.strip()
    if kind not in FAULT_TYPES:
        raise UserError(f"{where}: unknown fault type {kind!r}; one of {FAULT_TYPES}")
    values: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise UserError(f"{where}: expected key=value, got {part!r}")
        if key.strip() in values:  # the last would win: another fault than the one read
            raise UserError(f"{where}: {key.strip()} is given twice")
        values[key.strip()] = value.strip()
    unknown = [k for k in values if k not in KEYS]
    if unknown:  # before the missing layer: "lyer=10" is its typo
        close = difflib.get_close_matches(unknown[0], KEYS, n=1)
        raise UserError(f"{where}: unknown option {unknown[0]!r}"
                        + (f" (did you mean {close[0]}?)" if close else "")
                        + f"; the options are {', '.join(KEYS)}")
    if "layer" not in values:
        raise UserError(f"{where}: layer=K is required")
    def number(key: str, default: str, kind_of: type):
        value = values.pop(key, default)
        try:
            return kind_of(value)
        except ValueError:
            what = "a whole number" if kind_of is int else "a number"
            raise UserError(f"{where}: {key} must be {what}, got {value!r}") from None

    spec = FaultSpec(
        type=kind,
        layer=number("layer", "", int),
        site=values.pop("site", "attn" if kind in ATTENTION_KERNEL else "block"),
        m=number("m", "0.01" if kind == "mxfp4_deadzone" else "0.3", float),
        sparsity=number("sparsity", "1.0", float),
        seed=number("seed", "0", int),
        options=values,
    )
    if kind in ATTENTION_KERNEL and spec.site not in ("attn", "self_attn", "attention"):
        raise UserError(f"{where}: {kind} is a fault inside the attention kernel: "
                        "its site is attn")
    if not math.isfinite(spec.m):
        raise UserError(f"{where}: m must be a finite number")
    if not 0 < spec.sparsity <= 1:
        raise UserError(f"{where}: sparsity must be in (0, 1]")
    if spec.options.get("scope", "batch") not in ("batch", "sample"):
        raise UserError(f"{where}: scope must be batch or sample")
    if spec.options.get("per", "token") not in ("token", "tensor"):
        raise UserError(f"{where}: per must be token or tensor")
    if spec.options.get("phase", "all") not in ("all", "prefill", "decode"):
        raise UserError(f"{where}: phase must be all, prefill or decode")
    rank = spec.options.get("rank")
    if rank is not None and not (rank.isdigit()):
        raise UserError(f"{where}: rank must be a process rank (0, 1, ...)")
    for key, words in CHOICES.items():
        value = spec.options.get(key)
        if value is not None and value not in words.get(kind, words.get("", ())):
            allowed = words.get(kind, words.get(""))
            raise UserError(f"{where}: {key} must be one of {', '.join(allowed)}"
                            if allowed else f"{where}: {kind} takes no {key}")
    for key in ("limit", "quantile", "rate", "value", "shift"):
        if key in spec.options:
            try:
                value = float(spec.options[key])
            except ValueError:
                raise UserError(f"{where}: {key} must be a number") from None
            if key == "quantile" and not 0 < value < 1:
                raise UserError(f"{where}: quantile must be in (0, 1)")
            if key == "rate" and not 0 < value <= 1:
                raise UserError(f"{where}: rate is a probability: in (0, 1]")
            if key in ("limit", "shift") and not math.isfinite(value):
                raise UserError(f"{where}: {key} must be a finite number")
    return spec


