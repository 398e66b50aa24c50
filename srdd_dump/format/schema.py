"""HDF5 dump schema v5: the single definition shared by the writer and the reader.

Layout of one file (one per process), all readable with plain h5py:

    /                     attrs: format="srdd-dump", schema_version=5, meta (JSON), complete (0/1)
    /layers               (L,) utf-8 strings: captured module names, index = layer number
    /sites                (S,) utf-8 strings: sub-layer modules probed/captured (may be empty)
    /rounds               (R,) ROUND_DTYPE: one row per captured forward round
    /token_ids            (T,) int64: input ids of every round, sliced by rounds.tok_off/tok_len
    /positions            (P,) int32: kept token positions of every round (pos_off/pos_len)
    /probe_rows           (Q,) int32: rows kept for probe records of a round (prow_off/prow_len)
    /records              (N,) RECORD_DTYPE: one row per stored tensor, pointing into /data;
                          a round's probe outputs of one site are one KIND_PROBES record
    /probes               (M,) PROBE_DTYPE: one row per probe output, a slice of its
                          KIND_PROBES record (schema 5; absent in older files)
    /data/<name>          (rows, width) chunked, resizable; attr dtype = logical dtype name
    /stats/index          (K,) STATS_INDEX_DTYPE: one row per (round, layer, site) reduced on
                          the device (``--store stats``; absent otherwise)
    /stats/values         (K, C) float64: the reductions; attr columns = their names (JSON)

A tensor of shape (batch, seq, width) is stored as batch*ntok rows of one /data dataset, where
ntok is the number of kept token positions. Rows of /records are appended only after the rows
they point to, and the file is flushed after every round, so a file cut short by a crash is
still consistent up to its last flushed round.
"""

from __future__ import annotations

import numpy as np

FORMAT_NAME = "srdd-dump"
# 2: record kinds scale, causal and host (a v1 reader would take them for probe replays); v1
# files are read as before. 3: /stats (the statistics store); v1 and v2 files are read as before.
# 4: mixture-of-experts sites (roles router, experts, expert_slots, expert; KIND_ROUTE).
# 5: the probe outputs of one site in one round are one KIND_PROBES record (per logical dtype),
# described probe by probe in /probes; v1-v4 files (one record per probe output) are read as
# before (a v4 reader would have ignored the unknown kind and seen no probes).
SCHEMA_VERSION = 5
PARTIAL_SUFFIX = ".partial"
# A file whose write failed half-way (disk full) is renamed to <name>.h5.broken and not read:
# HDF5 may have recorded data that never reached the disk.
BROKEN_SUFFIX = ".broken"
FILE_SUFFIX = ".h5"
# Each `srdd-dump --exec` run writes into its own folder under -o: srdd_dump_<UTC time>, as
# msit's msit_dump_<time>; the compare takes the newest run of a folder unless told otherwise.
RUN_PREFIX = "srdd_dump_"
RUN_TIME_FORMAT = "%Y%m%d_%H%M%S"

ATTR_FORMAT = "format"
ATTR_VERSION = "schema_version"
ATTR_META = "meta"
ATTR_COMPLETE = "complete"
ATTR_STATUS = "status"
# the status program_error of a capture whose `with register_hook(...)` block an exception
# left (the program may have caught it and gone on: not "the program ended")
WITH_BLOCK_LEFT = "its with register_hook block was left by "
ATTR_DTYPE = "dtype"

LAYERS = "layers"
SITES = "sites"
PROBE_ROWS = "probe_rows"
ROUNDS = "rounds"
TOKEN_IDS = "token_ids"
POSITIONS = "positions"
RECORDS = "records"
PROBES = "probes"
DATA = "data"

STACK_INPUT = -1  # layer number of the block stack's input (embedding output)
BLOCK_SITE = -1  # site number of a block's own output (sites >= 0 index /sites)

# Record kinds. CLEAN is the unperturbed capture; the others are probe replays.
KIND_CLEAN = 0
KIND_GAIN = 1
KIND_DC = 2
KIND_REPEAT = 3
KIND_REPLAY = 4
# The rows of a round that the attention mask excludes (padding): one record per round at
# (STACK_INPUT, BLOCK_SITE), width 1, 1.0 = a row every statistic uses, 0.0 = excluded.
# Written only when a row is excluded. Readers that predate it never select it (layer -1).
KIND_MASK = 5
# Exact identities and the host reference (docs/method.md), all on the round's probe rows:
# SCALE: a linear operator's y(2^k x) * 2^-k on the probe rows of its input (param = k; k = 0 is
# the reference call of the same shape); CAUSAL: the output with the tokens at and after
# position ``param`` perturbed (rows before it must not move); HOST: the float64 replay of the
# module on the host CPU (``subset`` 0: every kept row, e.g. a model-level rotary embedding).
KIND_SCALE = 6
KIND_CAUSAL = 7
KIND_HOST = 8
# Mixture of experts (schema 4): at a fused experts module's "slots" site, the routing of every
# kept token row, width 2k: the k expert indices (as floats), then their k weights. The same
# site's clean and probe records hold each token slot's own expert output (width k * H).
KIND_ROUTE = 9
# The zero identity of a bias-free expert (its weights are all it has): the slots' outputs for
# all-zero input rows, replayed in one call with the probe rows; healthy: exactly 0.
KIND_ZERO = 10
# Schema 5: every probe output of one (round, layer, site) in one logical dtype, their rows
# concatenated in the order capture made them (stored as batch 1, ntok = all the rows); /probes
# says which rows are which probe (kind, probe, param, seed, pert_rms, subset, shape).
KIND_PROBES = 11
KIND_NAMES = {
    KIND_CLEAN: "clean",
    KIND_GAIN: "gain",
    KIND_DC: "dc",
    KIND_REPEAT: "repeat",
    KIND_REPLAY: "replay",
    KIND_MASK: "mask",
    KIND_SCALE: "scale",
    KIND_CAUSAL: "causal",
    KIND_HOST: "host",
    KIND_ROUTE: "route",
    KIND_ZERO: "zero",
    KIND_PROBES: "probes",
}
# Kinds a record of its own holds in every schema: the rest are probe outputs, grouped into a
# KIND_PROBES record from schema 5 on.
OWN_RECORD_KINDS = frozenset({KIND_CLEAN, KIND_MASK, KIND_ROUTE, KIND_PROBES})

ROUND_DTYPE = np.dtype(
    [
        ("round", "<i4"),  # running number of the captured forward round in this file
        ("sample", "<i4"),  # prefill count, 0-based
        ("step", "<i4"),  # 0 = prefill, k = k-th decode step after it
        ("batch", "<i4"),
        ("seq", "<i4"),  # tokens in this forward (per batch element)
        ("ntok", "<i4"),  # kept token positions
        ("pos_off", "<i8"),
        ("tok_off", "<i8"),
        ("tok_len", "<i8"),  # 0 when the input ids were not visible
        ("tokens_hash", "<u8"),  # hash of the input ids (0 if unknown)
        ("prow_off", "<i8"),  # slice of /probe_rows: rows of the clean record kept for probes
        ("prow_len", "<i4"),
        ("time", "<f8"),  # unix time at the start of the round
    ]
)

RECORD_DTYPE = np.dtype(
    [
        ("round", "<i4"),
        ("layer", "<i4"),  # STACK_INPUT or 0..L-1 (the block the site belongs to)
        ("site", "<i2"),  # BLOCK_SITE or an index into /sites
        ("kind", "u1"),  # KIND_*
        ("probe", "<i4"),  # draw / repeat index within the kind
        ("param", "<f8"),  # sigma for gain, constant for dc, 0 otherwise
        ("seed", "<i8"),
        ("pert_rms", "<f8"),  # RMS of the input perturbation over the stored rows (0 if none)
        ("subset", "u1"),  # 1: rows are the round's /probe_rows of the clean record; 0: all rows
        ("data", "<i4"),  # index into the sorted names of /data
        ("row0", "<i8"),
        ("nrows", "<i8"),
        ("batch", "<i4"),
        ("ntok", "<i4"),
        ("width", "<i4"),
    ]
)

# /probes (schema 5): one row per probe output, rows ``row0 : row0 + batch * ntok`` of the
# KIND_PROBES record ``record`` (an index into /records); the other fields mean what they mean
# in RECORD_DTYPE.
PROBE_DTYPE = np.dtype(
    [
        ("record", "<i8"),
        ("kind", "u1"),
        ("probe", "<i4"),
        ("param", "<f8"),
        ("seed", "<i8"),
        ("pert_rms", "<f8"),
        ("subset", "u1"),
        ("row0", "<i8"),  # first row within the KIND_PROBES record
        ("batch", "<i4"),
        ("ntok", "<i4"),
    ]
)

# logical dtype name -> numpy storage dtype. bf16 is stored losslessly as its raw uint16 bits.
STORAGE_DTYPES = {
    "float64": np.dtype("<f8"),
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
}

CHUNK_BYTES = 512 * 1024


# --store stats: the per-round reductions of every (layer, site), computed on the device
# (capture/reductions.py) by the arithmetic of analysis.signals.round_stats. One row per
# (round, layer, site); the columns are named, so a reader finds each by name.
STATS = "stats"
STATS_INDEX = "stats/index"
STATS_VALUES = "stats/values"
ATTR_COLUMNS = "columns"
STATS_INDEX_DTYPE = np.dtype(
    [
        ("round", "<i4"),
        ("layer", "<i4"),
        ("site", "<i2"),
        ("dtype", "u1"),  # index into DTYPE_CODES: the clean output's logical dtype
    ]
)
DTYPE_CODES = ("float32", "bfloat16", "float16", "float64")
# the clean output: Moments (count, mean, central sums M2..M4, absmax, zeros, NaN, Inf of the
# finite values) and the shape signals of analysis.signals.Signals
MOMENT_COLUMNS = ("n", "mean", "m2", "m3", "m4", "absmax", "zeros", "nan", "inf")
# the whole tensor's max, min and L2 norm: kept by files converted from an msprobe statistics
# dump (format/from_msprobe.py), which records these and not the higher moments
SUMMARY_COLUMNS = ("max", "min", "norm")
SHAPE_COLUMNS = ("pileup", "ties", "tie_excess", "update_rms", "offset", "dc_energy",
                 "consistency", "stuck", "lowbits", "rows", "topk_margin", "grid", "distinct")
BATCH_COLUMNS = ("batch_dep", "batch_dep_level", "batch_dep_moved")
DIFF_COLUMNS = ("diff_n", "diff_mean", "diff_m2", "diff_m3", "diff_m4")  # repeats' differences
SCALE_COLUMNS = ("scale_broken", "scale_judged", "scale_pattern", "scale_size")
CAUSAL_COLUMNS = ("causal_broken", "causal_judged", "causal_size")
HOST_COLUMNS = ("host_red", "host_channel_red")
DC_PARTS = ("dead", "flat_zero", "flat_value", "probed", "low")
REPEAT_PARTS = ("instability", "changed")
SCALE_PATTERNS = ("", "zero", "clip", "offset", "other")  # scale_pattern: index into these


def gain_column(sigma: float, probe: int) -> str:
    """The gain of one draw: ``probe`` numbers the draws of every sigma in turn."""
    return f"gain@{float(sigma)!r}#{int(probe)}"


def dc_column(value: float, part: str) -> str:
    return f"dc@{float(value)!r}:{part}"


def repeat_column(index: int, part: str) -> str:
    return f"repeat#{int(index)}:{part}"


def parse_probe_column(name: str) -> tuple[str, float, str] | None:
    """("gain", sigma, probe) / ("dc", value, part) / ("repeat", index, part) of a probe
    column; None for the fixed columns."""
    if name.startswith("gain@"):
        sigma, draw = name[5:].rsplit("#", 1)
        return "gain", float(sigma), draw
    if name.startswith("dc@"):
        value, part = name[3:].rsplit(":", 1)
        return "dc", float(value), part
    if name.startswith("repeat#"):
        index, part = name[7:].split(":", 1)
        return "repeat", float(index), part
    return None


def stat_columns(sigmas: tuple, draws: int, dc: tuple, repeats: int) -> list[str]:
    """Every column of a stats dump captured with these probes."""
    columns = [*MOMENT_COLUMNS, *SHAPE_COLUMNS, *BATCH_COLUMNS, *DIFF_COLUMNS, *SCALE_COLUMNS,
               *CAUSAL_COLUMNS, *HOST_COLUMNS]
    columns += [gain_column(s, i * draws + d) for i, s in enumerate(sigmas) for d in range(draws)]
    columns += [dc_column(v, part) for v in dc for part in DC_PARTS]
    columns += [repeat_column(r, part) for r in range(repeats) for part in REPEAT_PARTS]
    return columns


def data_name(kind: int, dtype: str, width: int) -> str:
    """Dataset name under /data for a (kind, logical dtype, width) stream."""
    return f"{KIND_NAMES[kind]}_{dtype}_{width}"


def chunk_rows(width: int, itemsize: int) -> int:
    return max(1, CHUNK_BYTES // max(1, width * itemsize))


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Decode bfloat16 raw bits (uint16) to float32 exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (round to nearest even) and return the raw uint16 bits."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(x)
    out = rounded.astype(np.uint16)
    out[nan] = 0x7FC0
    return out


def decode(stored: np.ndarray, dtype: str) -> np.ndarray:
    """Stored rows -> float array (float32, or float64 for float64 dumps)."""
    if dtype == "bfloat16":
        return bf16_bits_to_float32(stored)
    if dtype == "float64":
        return stored.astype(np.float64, copy=False)
    return stored.astype(np.float32, copy=False)
