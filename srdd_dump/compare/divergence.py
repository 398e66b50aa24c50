"""Across-layer reading of a baseline comparison: error growth, first divergence, summary.

Within one compared round (source, sample, step), rows are in layer order and the input of a
layer is the row before it: the previous layer's output, or for the stack input (layer -1,
the embedding output) the input ids, which agree where ``input_match`` says they are the same.

* ``error_amplification`` = RED(output) / max(RED(input), u), u = unit roundoff of the
  tolerance dtype (RED = relative_euclidean_distance; the input ids have RED 0).
* ``first_divergence``: where the error is born, also when it stays within tolerance. A row is
  a birth candidate when its input is within its rounding (exactly equal to the golden run's,
  or PASS) and the layer multiplies the error by at least BIRTH_GROWTH; with the same dtype on
  both sides, any non-zero error from an exactly equal input is one. The birth of a round is
  the last candidate at or before the round's first WARN/FAIL row (the layer that last
  multiplied the error that then breaks tolerance); a round that stays PASS has none.
* ``first_fail``: the first row of the round whose input PASSes and whose output FAILs (the
  earlier rule, msprobe's red node).
* ``highlight``: ``red`` on every row whose input PASSes and whose output FAILs, and on FAIL
  rows with NaN/Inf (msprobe's red); ``yellow`` on other WARN/FAIL rows whose error grew at
  least 10x across the layer (msprobe's yellow).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..analysis.matching import SAME
from ..analysis.tolerance import UNIT_ROUNDOFF
from ..analysis.verdicts import FAIL, NOT_COMPARED, PASS, VERDICT_RANK, VERDICTS, WARN
from ..format.layer_numbers import NUMBERED_PREFIX, site_pattern
from ..format.schema import STACK_INPUT
from ..vocabulary import ATTENTION_NAMES, MLP_NAMES
from .results import MD5_DIFFER, PER_LAYER_COLUMNS, BaselineSummary

GROUP = ["source", "golden_source", "sample", "golden_sample", "step"]
RED_COLUMN = "relative_euclidean_distance"
BOUND_COLUMN = "red_lower_bound"
YELLOW_GROWTH = 10.0
BIRTH_GROWTH = 10.0  # an accumulation of rounding errors does not grow 10x across one layer
BIRTH_SHARE = 0.1  # a birth found by growth alone recurs in this share of the breaking rounds
RED = "red"
YELLOW = "yellow"
WORST = 5


# a row's input, besides a row: the input ids (of the model's stack input), or unknown; apart
# from every layer number (the stack input is -1)
TOKENS, UNKNOWN = -10, -20


def input_rows(table: pd.DataFrame) -> np.ndarray:
    """Per row (position), the row whose outputs are its inputs on both sides: the row of the
    block just before on each side (the model's numbers: layer k's input is layer k-1's output,
    a dump's first block's is its stack input), TOKENS for the model's stack input on both
    sides (both dumps start at layer 0), UNKNOWN when either side's input is not in the table
    (a dump of some layers: the input of its stack input, of a block after a gap)."""
    out = np.full(len(table), UNKNOWN, dtype=np.int64)
    keys = table[GROUP].astype(object).where(table[GROUP].notna(), None)
    mine = _numbers(table["layer"])
    golden = _numbers(table["golden_layer"])
    groups: dict[tuple, list[int]] = {}
    for pos, key in enumerate(map(tuple, keys.to_numpy())):
        groups.setdefault(key, []).append(pos)
    for rows in groups.values():
        my_side = _Side({int(mine[p]) for p in rows if not np.isnan(mine[p])})
        golden_side = _Side({int(golden[p]) for p in rows if not np.isnan(golden[p])})
        at = {(int(mine[p]), int(golden[p])): p for p in rows
              if not (np.isnan(mine[p]) or np.isnan(golden[p]))}
        for (i, j), pos in at.items():
            a, b = my_side.before(i), golden_side.before(j)
            if a == TOKENS and b == TOKENS:
                out[pos] = TOKENS
            elif a is not None and b is not None:
                out[pos] = at.get((a, b), UNKNOWN)
    return out


def _numbers(column: pd.Series) -> np.ndarray:
    """A layer column as floats, NaN where empty (nullable Int64 columns included)."""
    return pd.to_numeric(column, errors="coerce").astype("float64").to_numpy(
        dtype=float, na_value=np.nan)


class _Side:
    """The layers one side of a round holds."""

    def __init__(self, present: set[int]):
        self.present = present
        blocks = [k for k in present if k >= 0]
        self.first = min(blocks) if blocks else None

    def before(self, layer: int) -> int | None:
        """The layer whose output is ``layer``'s input (STACK_INPUT -1 for the first block),
        TOKENS for the input of a dump that starts at the model's layer 0, None when unknown."""
        if layer < 0:
            return TOKENS if self.first == 0 else None
        if layer == self.first:
            if -1 in self.present:
                return -1
            return TOKENS if layer == 0 else None  # no stack input record: layer 0's is the ids
        return layer - 1 if layer - 1 in self.present else None


def input_reds(table: pd.DataFrame, rows: np.ndarray | None = None) -> np.ndarray:
    """Per row, the relative error of its input (``input_rows``): 0 from agreeing input ids,
    NaN when unknown or not compared."""
    rows = input_rows(table) if rows is None else rows
    red = _bounded(table)[RED_COLUMN].to_numpy(dtype=float, na_value=np.nan)
    verdict = table["verdict"].to_numpy()
    match = table["input_match"].to_numpy()
    out = np.full(len(table), math.nan)
    for pos, src in enumerate(rows):
        if src == TOKENS:
            out[pos] = 0.0 if match[pos] == SAME else math.nan
        elif src >= 0 and verdict[src] != NOT_COMPARED:
            out[pos] = red[src]
    return out


def _measured(table: pd.DataFrame) -> np.ndarray:
    """Per row: its relative error was measured on tensors (not a bound its statistics
    prove: a statistics-only row)."""
    return (table[BOUND_COLUMN].isna().to_numpy() if BOUND_COLUMN in table
            else np.ones(len(table), dtype=bool))


def exact_inputs(table: pd.DataFrame, rows: np.ndarray, reds: np.ndarray) -> np.ndarray:
    """Per row, whether its input is proven equal on both sides: agreeing input ids, or an
    input row of relative error 0 measured on tensors. A statistics-only row's bound of 0
    proves no equality (an error that keeps Max, Min, Mean and Norm is not seen). ``rows``
    and ``reds``: ``input_rows`` and ``input_reds`` of the table."""
    measured = _measured(table)
    return np.array([red == 0 and (src == TOKENS or (src >= 0 and measured[src]))
                     for red, src in zip(reds, rows)], dtype=bool)


def mark_divergence(table: pd.DataFrame, same_device: dict[tuple[str, str], bool] | None = None
                    ) -> pd.DataFrame:
    """Add ``error_amplification``, ``highlight``, ``first_divergence`` (the birth of the error)
    and ``first_fail`` (table in order). ``same_device`` (``_same_setup``): where the pairs ran
    on one device type, any non-zero error from an exactly equal input of the same dtype is a
    birth (elsewhere two devices round differently from layer 0 on)."""
    amp = np.full(len(table), math.nan)
    highlight = np.full(len(table), "", dtype=object)
    first = np.zeros(len(table), dtype=bool)
    fail = np.zeros(len(table), dtype=bool)
    has_layer = table["layer"].notna() | table["golden_layer"].notna()
    keys = table[GROUP].astype(object).where(table[GROUP].notna(), None)
    groups: dict[tuple, list[int]] = {}
    for pos, (key, ok) in enumerate(zip(map(tuple, keys.to_numpy()), has_layer)):
        if ok:
            groups.setdefault(key, []).append(pos)
    verdict = table["verdict"].to_numpy()
    red = _bounded(table)[RED_COLUMN].to_numpy(dtype=float)
    # a growth of lower bounds proves no growth: such a row is a birth only beyond tolerance
    bounded = table[RED_COLUMN].isna().to_numpy() & ~np.isnan(red)
    tolerance = table["tolerance"].to_numpy()
    match = table["input_match"].to_numpy()
    same_setup = _same_setup(table, same_device)
    nonfinite = (table["golden_nan_inf"].fillna(0) + table["my_nan_inf"].fillna(0)).to_numpy()
    sources = input_rows(table)
    reds = input_reds(table, sources)
    exact = exact_inputs(table, sources, reds)
    for rows in groups.values():
        found = False
        candidates: list[int] = []
        breaks = None  # the round's first WARN/FAIL row
        for pos in rows:
            src = sources[pos]
            # input ids known to agree: not unknown ids (an msprobe dump of block outputs
            # only, a step the golden run skipped: a later token that differs is no birth)
            input_ok = (match[pos] == SAME if src == TOKENS
                        else src >= 0 and verdict[src] == PASS)
            input_red = reds[pos]
            if verdict[pos] == NOT_COMPARED:
                continue
            floor = UNIT_ROUNDOFF.get(tolerance[pos], 0.0)
            amp[pos] = _ratio(red[pos], max(input_red, floor))
            if verdict[pos] == FAIL and (input_ok or nonfinite[pos] > 0):
                highlight[pos] = RED
            elif verdict[pos] in (WARN, FAIL) and amp[pos] >= YELLOW_GROWTH:
                highlight[pos] = YELLOW
            if verdict[pos] == FAIL and input_ok and not found:
                fail[pos] = found = True
            exact_input = exact[pos] and same_setup[pos]
            # a bound above 0 from an input proven equal (md5) is a proven birth too
            proven = (not bounded[pos] or verdict[pos] in (WARN, FAIL)
                      or (exact_input and red[pos] > 0))
            if input_ok and breaks is None and proven and (
                    amp[pos] >= BIRTH_GROWTH or (exact_input and red[pos] > 0)
                    or (verdict[pos] == FAIL and nonfinite[pos] > 0)):
                candidates.append(pos)
            if breaks is None and verdict[pos] in (WARN, FAIL):
                breaks = pos
        if breaks is not None and candidates:
            first[candidates[-1]] = True
    out = table.copy()
    out["error_amplification"] = amp
    out["highlight"] = highlight
    out["first_divergence"] = first
    out["first_fail"] = fail
    return out


def mark_sites(sites: pd.DataFrame, table: pd.DataFrame,
               same_device: dict[tuple[str, str], bool] | None = None) -> pd.DataFrame:
    """Add ``error_amplification`` (a site's relative error over its block's input's: the
    previous row of the block table) and ``first_divergence``: in each round and layer where the
    block table marks the birth of the error, among the sites whose error grew BIRTH_GROWTH-fold
    or more (or, with the same setup on both sides, became non-zero from an exact input, or
    turned NaN/Inf), in the order their outputs were made, the last at or before the first
    site beyond tolerance; where there is none, the first."""
    table, sites_in = _bounded(table), sites
    sites = _bounded(sites)
    # (group, layer) -> (input RED, birth layer, input proven equal)
    inputs: dict[tuple, tuple[float, bool, bool]] = {}
    keys = table[GROUP].astype(object).where(table[GROUP].notna(), None)
    sources = input_rows(table)
    reds = input_reds(table, sources)
    for key, layer, input_red, first, equal in zip(
            map(tuple, keys.to_numpy()), table["layer"], reds,
            table["first_divergence"], exact_inputs(table, sources, reds)):
        if not pd.isna(layer):
            inputs[(key, int(layer))] = (float(input_red), bool(first), bool(equal))
    amp = np.full(len(sites), math.nan)
    first = np.zeros(len(sites), dtype=bool)
    same_setup = _same_setup(sites, same_device)
    # (group, layer) of a birth layer -> its candidate sites, and its first WARN/FAIL site
    candidates: dict[tuple, list[int]] = {}
    breaks: dict[tuple, int] = {}
    site_keys = sites[GROUP].astype(object).where(sites[GROUP].notna(), None)
    nonfinite = (sites["golden_nan_inf"].fillna(0) + sites["my_nan_inf"].fillna(0)).to_numpy()
    for pos, (key, layer, red, verdict, tol) in enumerate(zip(
            map(tuple, site_keys.to_numpy()), sites["layer"], sites[RED_COLUMN],
            sites["verdict"], sites["tolerance"])):
        if pd.isna(layer) or verdict == NOT_COMPARED or (key, int(layer)) not in inputs:
            continue
        input_red, birth_layer, equal = inputs[(key, int(layer))]
        amp[pos] = _ratio(float(red), max(input_red, UNIT_ROUNDOFF.get(tol, 0.0)))
        at = (key, int(layer))
        if not birth_layer:
            continue
        exact = equal and same_setup[pos] and red > 0
        if amp[pos] >= BIRTH_GROWTH or exact or (verdict == FAIL and nonfinite[pos] > 0):
            candidates.setdefault(at, []).append(pos)
        if verdict in (WARN, FAIL):
            breaks.setdefault(at, pos)
    # as for blocks: the last candidate at or before the first site beyond tolerance (a
    # norm that grew two devices' rounding tenfold comes before the MLP that broke it);
    # where no site breaks tolerance, or none before the first that does, the first
    for at, found in candidates.items():
        before = [pos for pos in found if pos <= breaks.get(at, -1)]
        first[before[-1] if before else found[0]] = True
    out = sites_in.copy()
    out["error_amplification"] = amp
    out["first_divergence"] = first
    return out


def _bounded(table: pd.DataFrame) -> pd.DataFrame:
    """The table with RED, where a side had statistics only, replaced by the RED those prove
    (its lower bound, BOUND_COLUMN): the across-layer reading works on it."""
    if BOUND_COLUMN not in table or not table[BOUND_COLUMN].notna().any():
        return table
    out = table.copy()
    out[RED_COLUMN] = out[RED_COLUMN].where(out[RED_COLUMN].notna(), out[BOUND_COLUMN])
    return out


def _same_setup(table: pd.DataFrame, same_device: dict[tuple[str, str], bool] | None
                ) -> np.ndarray:
    """Per row: both sides have the same dtype and ran on one device type. ``same_device``:
    (source, golden source) -> True when both files name that device type, False when either
    names none (an msprobe dump): there a row counts as one setup when its input is the output
    of a computed block (any but the first block of its dump: the layer numbers are the model's,
    and a dump of some blocks starts later), since that block's output equal bit for bit on
    both sides shows one kernel set (a device of another type would have differed there
    already)."""
    pairs = same_device or {}
    dtype = (table["my_dtype"].astype(str) == table["golden_dtype"].astype(str)).to_numpy()
    layer = pd.to_numeric(table["layer"], errors="coerce").fillna(-1)
    first = layer[layer >= 0].groupby(table["source"]).min().to_dict()
    device = np.array([pairs.get((a, b)) is True
                       or (pairs.get((a, b)) is False and k > first.get(a, math.inf))
                       for a, b, k in zip(table["source"], table["golden_source"], layer)],
                      dtype=bool)
    return dtype & device


def _ratio(num: float, den: float) -> float:
    if math.isnan(num) or math.isnan(den):
        return math.nan
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


def per_layer(table: pd.DataFrame) -> pd.DataFrame:
    """Worst values of every layer over all compared rounds and sources, in layer order."""
    rows = table[(table["verdict"] != NOT_COMPARED) & table["layer"].notna()]
    if rows.empty:
        return pd.DataFrame(columns=PER_LAYER_COLUMNS)
    grouped = rows.groupby("layer", sort=True)
    out = pd.DataFrame({
        "module": grouped["module"].first(),
        "rows": grouped.size(),
        "verdict": grouped["verdict"].agg(lambda v: max(v, key=VERDICT_RANK.__getitem__)),
        "min_cosine_similarity": grouped["cosine_similarity"].min(),
        "max_relative_euclidean_distance": grouped[RED_COLUMN].max(),
        "max_error_amplification": grouped["error_amplification"].max(),
        "first_divergences": grouped["first_divergence"].sum().astype(int),
    }).reset_index()
    out["layer"] = out["layer"].astype(int)
    return out[PER_LAYER_COLUMNS]


def _one_file(compared: pd.DataFrame, at: pd.DataFrame) -> str:
    """'; the birth's N rounds all in FILE (N of its K compared rounds)' when they all lie in
    one of several compared files (one card of a multi-rank run): the count over every file
    reads as an intermittent fault."""
    files = compared["source"].unique()
    born = at["source"].unique()
    if len(files) < 2 or len(born) != 1:
        return ""
    own = len(compared.loc[compared["source"] == born[0], GROUP].drop_duplicates())
    return (f"; the birth's {len(at)} round{'s' if len(at) != 1 else ''} all in {born[0]} "
            f"({len(at)} of its {own} compared rounds; "
            f"{len(files) - 1} other file{'s' if len(files) > 2 else ''} compared)")


def _worst_first(layers: pd.DataFrame) -> pd.Index:
    """The per-layer rows worst first: by verdict, then by relative error, a layer whose
    compared rows hold no finite value (NaN error) first among its verdict's."""
    rank = layers["verdict"].map(VERDICT_RANK).fillna(-1)
    red = pd.to_numeric(layers["max_relative_euclidean_distance"], errors="coerce")
    order = pd.DataFrame({"rank": rank, "red": red.fillna(np.inf)}, index=layers.index)
    return order.sort_values(["rank", "red"], ascending=False, kind="mergesort").index


def summarize(table: pd.DataFrame, same_device: dict[tuple[str, str], bool] | None = None,
              sites: pd.DataFrame | None = None) -> BaselineSummary:
    table = _bounded(table)
    counts = table["verdict"].value_counts()
    verdicts = {v: int(counts.get(v, 0)) for v in VERDICTS}
    compared = table[table["verdict"] != NOT_COMPARED]
    rounds = len(compared[GROUP].drop_duplicates()) if len(compared) else 0
    layers = per_layer(table)
    worst = layers.loc[_worst_first(layers)].head(WORST)
    reasons = table.loc[table["verdict"] == NOT_COMPARED, "cmp_fail_reason"]
    not_compared = _reason_counts(reasons)
    firsts = table[table["first_divergence"]]
    summary = BaselineSummary(
        verdicts=verdicts, rounds=rounds, first_divergence=firsts, first_layer=None,
        first_module="", first_rounds=0, per_layer=layers, worst=worst,
        not_compared=not_compared,
        bounded=BOUND_COLUMN in table and bool(table[BOUND_COLUMN].notna().any()),
    )
    same_setup = _same_setup(table, same_device)
    sources = input_rows(table)
    reds = input_reds(table, sources)
    exact = exact_inputs(table, sources, reds)
    marked = firsts
    firsts = _recurring(table, firsts, same_setup, exact, sources)
    summary.first_divergence = firsts
    if len(firsts):
        layer = int(firsts["layer"].min())
        at = firsts[firsts["layer"] == layer]
        summary.first_layer, summary.first_module = layer, str(at["module"].iloc[0])
        if layer < 0:  # the stack input: named by the block it feeds
            blocks = table.loc[table["layer"] == table.loc[table["layer"] >= 0, "layer"].min(),
                               "module"]
            summary.first_module = str(blocks.iloc[0]) if len(blocks) else ""
        summary.first_rounds = len(at)
        birth = int(at[RED_COLUMN].fillna(-1.0).idxmax())
        summary.first_exact_input = bool(exact[birth])
        if sites is not None:
            _first_site(summary, at, sites)
    summary.pattern, summary.message = _explain(summary, compared, same_setup, reds, sources,
                                                exact)
    if summary.pattern == "clean":
        summary.message += _uncompared(table)
        if sites is not None:
            summary.message += _site_after_exact(sites)
    # a site's growth is judged against its own block input, compared on both sides: also
    # where the error is already at the first layer a subset dump holds
    if summary.pattern in ("gradual", "clean", "unlocated") and sites is not None:
        _site_origin(summary, table, sites)
    if summary.pattern == "unlocated" and sites is not None:
        _first_red_site(summary, table, sites)
    if compared.empty and sites is not None:
        summary.message = _sites_only(sites) or summary.message
    if summary.first_layer is None and len(marked):
        summary.message += _unnamed_births(marked, len(compared[GROUP].drop_duplicates()))
    if summary.first_site:
        summary.message += (f"; inside it, first at {summary.first_site} "
                            f"({summary.first_site_rounds} of {summary.first_rounds} rounds)")
    if summary.first_layer is not None:  # after the site: "inside it" is the layer
        summary.message += _one_file(compared, firsts[firsts["layer"] == summary.first_layer])
    if sites is not None:
        summary.unmatched = unmatched_lines(sites)
    return summary


def _site_origin(summary: BaselineSummary, table: pd.DataFrame, sites: pd.DataFrame) -> None:
    """No block multiplied the error BIRTH_GROWTH-fold, but a sub-layer or operator did: it
    FAILs, in the rounds where it FAILs, with typically (the median over those rounds)
    BIRTH_GROWTH times its block input's relative error. A fault whose error is of the size of
    the rounding difference of the two setups (bf16 against fp32: about 1% by the middle
    layers) grows its block's error a few times only, while the sub-layer it sits in still
    grows it tenfold. Named as the finding (pattern "site") when it recurs at its layer as a
    birth must (``_recurring``); the earliest such layer."""
    failing = (sites["verdict"] == FAIL) & sites["layer"].notna()
    fails = sites[failing].assign(
        growth=pd.to_numeric(sites.loc[failing, "error_amplification"], errors="coerce"))
    # FAILs after a round's first that grew BIRTH_GROWTH-fold are no birth: the residual
    # stream carries that layer's error on (its block's relative error, dominated by a few
    # large rows such as an attention sink's, may look back within tolerance; the later MLPs'
    # then look grown)
    if fails.empty:
        return
    grown = fails["growth"] >= BIRTH_GROWTH
    first = fails["layer"].where(grown).groupby(
        [fails[k] for k in GROUP], dropna=False).transform("min")
    fails = fails[first.isna() | (fails["layer"] <= first)]
    need = _recurrence(table)
    per_round = fails.groupby(GROUP + ["layer"], dropna=False)["growth"].max()
    by_layer = per_round.groupby(level="layer").agg(["count", "median"])
    layers = sorted(int(k) for k, row in by_layer.iterrows()
                    if row["count"] >= need and row["median"] >= BIRTH_GROWTH)
    if not layers:
        summary.message += _too_few_site_rounds(fails, by_layer, summary.rounds)
        return
    layer = layers[0]
    at = fails[fails["layer"] == layer]
    # each round's first site that grew the error tenfold (an absolute limit such as
    # --max-abs-fail may fail the norm before it too), else its first FAIL, in order
    grew = at["growth"] >= BIRTH_GROWTH
    firsts = [(rows[grew[rows.index]] if grew[rows.index].any() else rows)["module"].iloc[0]
              for _, rows in at.groupby(GROUP, dropna=False, sort=False)]
    counts = pd.Series(firsts).value_counts()
    block = table[(table["layer"] == layer) & (table["verdict"] != NOT_COMPARED)]
    summary.first_layer = layer
    named = table.loc[table["layer"] == layer, "module"].dropna()
    summary.first_module = (str(block["module"].iloc[0]) if len(block) else
                            str(named.iloc[0]) if len(named) else _block_of(at["module"]))
    summary.first_rounds = int(by_layer.loc[layer, "count"])
    summary.first_site, summary.first_site_rounds = str(counts.index[0]), int(counts.iloc[0])
    at = _bounded(at)  # a statistics side: the RED its statistics prove
    worst = at.loc[pd.to_numeric(at[RED_COLUMN], errors="coerce").fillna(-1.0).idxmax()]
    growth = block["error_amplification"].max() if len(block) else math.nan
    tol = ", ".join(sorted(set(at["tolerance"].astype(str))))
    summary.pattern = "site"
    summary.message = (
        f"error born inside layer {layer} ({summary.first_module}): a sub-layer's output "
        f"FAILs in {summary.first_rounds} of {summary.rounds} compared rounds at {tol} "
        f"tolerance, with x{by_layer.loc[layer, 'median']:.3g} its block input's relative "
        f"error (the median; {error_words(worst, 'up to ')}), "
        + ("the block's own output not compared (see its cmp_fail_reason)" if block.empty
           else f"the block's own output x{growth:.3g}" if growth >= BIRTH_GROWTH else
           f"while the block's own output grows it x{growth:.3g} at most (the rounding "
           "difference of the two setups is of the same size there)")
        + ": look at this layer first")


def _too_few_site_rounds(fails: pd.DataFrame, by_layer: pd.DataFrame, rounds: int) -> str:
    """'; layer K's SITE FAILs with xG its block input's error in 1 of N compared rounds only
    ...': the earliest layer whose sub-layer is a round's first FAIL with BIRTH_GROWTH x its
    block input's error, in fewer rounds than a birth must recur in, said rather than left
    unsaid (one prompt, one batched forward: the prefill may be the only such round)."""
    grown = [int(k) for k, row in by_layer.iterrows() if row["median"] >= BIRTH_GROWTH]
    if not grown:
        return ""
    layer = min(grown)
    at = _bounded(fails[(fails["layer"] == layer) & (fails["growth"] >= BIRTH_GROWTH)])
    if at.empty:
        return ""
    row = at.loc[at["growth"].idxmax()]
    steps = sorted({int(k) for k in at["step"].dropna()})
    which = ", ".join("the prefill" if k == 0 else f"decode step {k}" for k in steps)
    n = int(by_layer.loc[layer, "count"])
    return (f"; layer {layer}'s {row['module']} FAILs with x{row['growth']:.3g} its block "
            f"input's error in {n} of {rounds} compared rounds only ({which}; "
            f"{error_words(row)}), the first tenfold growth of "
            f"{'its round' if n == 1 else 'those rounds'}: too few to name it (one round can "
            "grow that much by chance), but look there first; a comparison of more prompts "
            "decides")


def _block_of(modules: pd.Series) -> str:
    """The block a site's name names (model.layers.8.self_attn -> model.layers.8)."""
    found = NUMBERED_PREFIX.match(str(modules.iloc[0])) if len(modules) else None
    return f"{found['stack']}.{found['index']}" if found else ""


def _site_after_exact(sites: pd.DataFrame) -> str:
    """'; but inside layer K, SITE is beyond tolerance ...' when every block passes yet, in
    some round, a sub-layer or operator is beyond tolerance right after one that agrees
    exactly (a relative error of 0 measured; in the order their outputs were made): with
    that input equal, the error appears in it, as msprobe's first red node (a mix dump)."""
    measured = pd.Series(_measured(sites), index=sites.index)
    found: dict[tuple[int, str], int] = {}  # (layer, site) -> rounds
    place: dict[tuple[int, str], int] = {}  # its earliest place in the order outputs were made
    worst: dict[tuple[int, str], pd.Series] = {}
    compared = sites[sites["layer"].notna() & (sites["verdict"] != NOT_COMPARED)]
    for _, rows in compared.groupby(GROUP + ["layer"], dropna=False, sort=False):
        k = next((i for i, v in enumerate(rows["verdict"]) if v in (WARN, FAIL)), 0)
        before = rows.index[k - 1] if k > 0 else None
        if before is None or rows.at[before, RED_COLUMN] != 0 or not measured[before]:
            continue  # the first beyond tolerance is not right after an exact site
        row = rows.iloc[k]
        key = (int(row["layer"]), str(row["module"]))
        found[key] = found.get(key, 0) + 1
        place[key] = min(place.get(key, k), k)
        if key not in worst or row[RED_COLUMN] > worst[key][RED_COLUMN]:
            worst[key] = row
    if not found:
        return ""
    layer = min(key[0] for key in found)
    layer, site = min((key for key in found if key[0] == layer),
                      key=lambda key: (-found[key], place[key]))
    row = worst[(layer, site)]
    rounds = len(compared.loc[compared["layer"] == layer, GROUP].drop_duplicates())
    return (f"; but inside layer {layer}, {site} is beyond {row['tolerance']} tolerance "
            f"({row['verdict']}, {error_words(row)}) right after a site that agrees "
            f"exactly ({found[(layer, site)]} of "
            f"{rounds} compared rounds): look there")


def _after_sites(summary: BaselineSummary, table: pd.DataFrame, at: pd.DataFrame,
                 layer: int) -> None:
    """The block's output is beyond tolerance while every sub-layer and operator of it
    compared agrees bit for bit (a dump of one layer's modules): the change is in the block's
    own code after them (its residual adds) or was made to a sub-layer's output after it was
    recorded (a hook run after msprobe's)."""
    block = table[(table["layer"] == layer) & (table["verdict"] != NOT_COMPARED)]
    broken = block[block["verdict"].isin([WARN, FAIL])]
    if broken.empty:
        return
    worst = broken.loc[pd.to_numeric(broken[RED_COLUMN], errors="coerce").fillna(-1.0).idxmax()]
    rounds = len(broken[GROUP].drop_duplicates())
    summary.first_layer, summary.first_rounds = layer, rounds
    summary.first_module = str(worst["module"])
    summary.first_site = ""
    parts = {str(m)[len(summary.first_module) + 1:] for m in at["module"]}
    whole = bool(parts & set(ATTENTION_NAMES)) and bool(parts & set(MLP_NAMES))
    summary.pattern = "site"
    summary.message = (
        f"error born inside layer {layer} ({summary.first_module})"
        + (", after its sub-layers" if whole else "") + f": in {rounds} of {summary.rounds} "
        f"compared rounds its output is beyond {worst['tolerance']} tolerance "
        f"({worst['verdict']}, {error_words(worst)}) while all {at['module'].nunique()} of its "
        "modules compared agree with the golden run bit for bit: "
        + ("the change is in the block's own code after them (its residual adds), or was "
           "made to a sub-layer's output after it was recorded (a hook run after the dump's)"
           if whole else "its attention and MLP are not both among them, so the change is in "
           "a module not compared, in the block's own code, or made to an output after it "
           "was recorded")
        + ": look at this layer first")


def _unnamed_births(marked: pd.DataFrame, rounds: int) -> str:
    """'; first_divergence marks layer K in 1 round only ...': the rows marked as a birth when
    too few rounds hold it for the finding to name it (``_recurring``), so the table's marks
    and the finding do not read as two answers."""
    layer = int(marked["layer"].min())
    at = marked[marked["layer"] == layer]
    row = at.loc[pd.to_numeric(at[RED_COLUMN], errors="coerce").fillna(-1.0).idxmax()]
    n = len(at.drop_duplicates(GROUP))
    where = "the stack input" if layer < 0 else f"layer {layer} ({row['module']})"
    growth = pd.to_numeric(row["error_amplification"], errors="coerce")
    how = (f", x{growth:.3g} its input's error): too few to name it, as one round can grow "
           "that much by chance" if pd.notna(growth) and np.isfinite(growth)
           else "): too few to name it")
    return (f"; first_divergence marks {where} in {n} of {rounds} rounds only "
            f"({row['verdict']}{how}; look at those rows")


def _first_red_site(summary: BaselineSummary, table: pd.DataFrame, sites: pd.DataFrame
                    ) -> None:
    """The error is beyond tolerance at a layer whose input is not compared (msprobe's level
    mix, a list of one layer's modules), but its sub-layers are: in each round, the first of
    them beyond tolerance after one or more that agree (in the order they ran) is where the
    error appears, as msprobe's first red node. Named (pattern "site") when the same one is
    it in the rounds a birth must recur in (``_recurrence``)."""
    bad = summary.per_layer[summary.per_layer["verdict"] != PASS]
    if bad.empty:
        return
    layer = int(bad.iloc[0]["layer"])
    at = sites[(sites["layer"] == layer).to_numpy(dtype=bool, na_value=False)
               & (sites["verdict"] != NOT_COMPARED).to_numpy(dtype=bool)]
    measured = pd.Series(_measured(at), index=at.index)
    if len(at) and measured.all() and (pd.to_numeric(at[RED_COLUMN], errors="coerce") == 0).all():
        _after_sites(summary, table, at, layer)
        return
    firsts, before, exact = [], {}, set()
    for _, rows in _bounded(at).groupby(GROUP, dropna=False, sort=False):
        red = (rows["verdict"] != PASS).to_numpy()
        measured_errors = pd.to_numeric(rows[RED_COLUMN], errors="coerce").to_numpy()
        errors = np.nan_to_num(measured_errors, nan=0.0)
        k = int(red.argmax())
        # sub-layers that agree, then one beyond tolerance that grows their largest error
        # BIRTH_GROWTH-fold at least, as a birth must
        if red.any() and k > 0 and errors[k] >= BIRTH_GROWTH * errors[:k].max():
            firsts.append(rows.index[k])
            before.setdefault(rows["module"].iloc[k], list(rows["module"].iloc[:k]))
            if (measured_errors[:k] == 0).all() and measured[rows.index[:k]].all():
                exact.add(rows.index[k])  # after sites equal bit for bit: proven
    if not firsts:
        return
    counts = sites.loc[firsts, "module"].value_counts()
    site, rounds = str(counts.index[0]), int(counts.iloc[0])
    named = sites.loc[[i for i in firsts if sites.at[i, "module"] == site]]
    if rounds < _recurrence(table) or not (
            (named["verdict"] == FAIL).any() or all(i in exact for i in named.index)):
        return  # a FAIL among them, or a WARN after exact sites: a birth, not rounding
    worst = _bounded(named).loc[lambda t: pd.to_numeric(
        t[RED_COLUMN], errors="coerce").fillna(-1.0).idxmax()]
    block = table[(table["layer"] == layer) & (table["verdict"] != NOT_COMPARED)]
    tol = ", ".join(sorted(set(named["tolerance"].astype(str))))
    summary.first_layer, summary.first_rounds = layer, rounds
    summary.first_module = str(block["module"].iloc[0]) if len(block) else ""
    summary.first_site, summary.first_site_rounds = site, rounds
    summary.site_verdicts = (WARN, FAIL)  # the rows named: a WARN after exact sites too
    summary.pattern = "site"
    summary.message = (
        f"error born inside layer {layer} ({summary.first_module}): in {rounds} of "
        f"{summary.rounds} compared rounds {', '.join(before[site])} "
        f"agree{'s' if len(before[site]) == 1 else ''} with the golden run "
        f"and {site} is beyond {tol} tolerance ({worst['verdict']}, "
        f"{error_words(worst, 'up to ')}); the block's input is not compared, so its "
        "sub-layers place it: look at this layer first")


def mark_site_birth(summary: BaselineSummary, table: pd.DataFrame, sites: pd.DataFrame
                    ) -> None:
    """A birth found inside a layer (pattern "site", ``_site_origin``) marked where a birth by
    growth is: ``first_divergence`` on the site's FAIL rows and on its block's rows of the
    same rounds (the rows a user filters for, the report's bold rows)."""
    if summary.pattern != "site" or sites is None or not len(sites):
        return
    # layer columns are nullable (a row of no layer): NA is no match
    at = ((sites["layer"] == summary.first_layer) & (sites["module"] == summary.first_site)
          & sites["verdict"].isin(summary.site_verdicts)).to_numpy(dtype=bool, na_value=False)
    sites.loc[at, "first_divergence"] = True
    keys = table[GROUP].astype(object).to_numpy()
    in_layer = (table["layer"] == summary.first_layer).to_numpy(dtype=bool, na_value=False)
    if summary.first_site:
        rounds = set(map(tuple, sites.loc[at, GROUP].astype(object).to_numpy()))
        block = in_layer & np.array([tuple(k) in rounds for k in keys], dtype=bool)
    else:  # born after its sub-layers (_after_sites): the block's rows beyond tolerance
        block = in_layer & table["verdict"].isin([WARN, FAIL]).to_numpy()
    table.loc[block, "first_divergence"] = True
    summary.first_divergence = table[block]


def _first_site(summary: BaselineSummary, births: pd.DataFrame, sites: pd.DataFrame) -> None:
    """The site most often marked as the birth inside the birth layer, over its birth rounds."""
    rounds = set(map(tuple, births[GROUP].astype(object).to_numpy()))
    marked = sites[sites["first_divergence"] & (sites["layer"] == summary.first_layer)]
    marked = marked[[tuple(k) in rounds for k in marked[GROUP].astype(object).to_numpy()]]
    if len(marked):
        counts = marked["module"].value_counts()
        summary.first_site, summary.first_site_rounds = str(counts.index[0]), int(counts.iloc[0])


def unmatched_lines(sites: pd.DataFrame) -> list[str]:
    """One line per site name (its layer number as N) and side that paired with nothing."""
    rows = sites[sites["cmp_fail_reason"].str.startswith("no counterpart: ")]
    found: dict[tuple[str, str, str], set] = {}
    for mine, golden, layer, reason in zip(rows["module"], rows["golden_module"], rows["layer"],
                                           rows["cmp_fail_reason"]):
        side, name = ("my", mine) if mine else ("golden", golden)
        why = ": a stats dump keeps rows of its block outputs only" if "stats dump" in reason \
            else ""
        found.setdefault((side, site_pattern(name), why), set()).add(layer)
    return [f"{side} site {name} ({len(layers)} layer{'s' if len(layers) > 1 else ''}): no "
            f"counterpart in {'the golden dump' if side == 'my' else 'my dump'}{why}"
            for (side, name, why), layers in sorted(found.items())]


def _recurring(table: pd.DataFrame, births: pd.DataFrame, same_setup: np.ndarray,
               exact_input: np.ndarray, sources: np.ndarray) -> pd.DataFrame:
    """The births the summary names. One from an exactly equal input with the same dtype on
    both sides is conclusive on its own; one found by growth alone must recur at its layer, in
    at least 2 rounds and BIRTH_SHARE of the rounds that break tolerance (``_recurrence``): one
    decode step of 576 values in bf16 against fp32 can grow 15x by chance (SmolLM2, 1 of 154
    rounds). ``sources``: ``input_rows`` of the table."""
    if births.empty:
        return births
    need = _recurrence(table)
    exact = np.array([bool(exact_input[int(pos)] and same_setup[int(pos)])
                      for pos in births.index], dtype=bool)
    # statistics-only rows whose bound jumps BIRTH_GROWTH-fold at the layer in other rounds:
    # no birth each (bounds prove no growth), but the same layer again
    jumps = pd.Series(False, index=table.index)
    if BOUND_COLUMN in table:
        # as a birth's: from a passing input, in a round that breaks tolerance
        verdict = table["verdict"].to_numpy()
        fed = np.array([src >= 0 and verdict[src] == PASS for src in sources], dtype=bool)
        breaking = table[table["verdict"].isin([WARN, FAIL])][GROUP].drop_duplicates()
        broken = table[GROUP].apply(tuple, axis=1).isin(set(map(tuple, breaking.to_numpy())))
        jumps = table[BOUND_COLUMN].notna() & pd.Series(fed, index=table.index) & broken & (
            pd.to_numeric(table["error_amplification"], errors="coerce") >= BIRTH_GROWTH)
    seen = pd.concat([births, table[jumps]])
    rounds = seen.drop_duplicates(subset=[*GROUP, "layer"])["layer"].value_counts()
    counts = births["layer"].map(rounds)
    return births[exact | (counts.to_numpy() >= need)]


def _recurrence(table: pd.DataFrame) -> float:
    """The rounds a birth found by growth alone must recur in: 2, and BIRTH_SHARE of the rounds
    that break tolerance; 1 when one round was compared (one forward, as msit compares it:
    its own growth is all the evidence there is)."""
    compared = table[table["verdict"] != NOT_COMPARED][GROUP].drop_duplicates()
    breaking = table[table["verdict"].isin([WARN, FAIL])][GROUP].drop_duplicates()
    return max(min(2, len(compared)), BIRTH_SHARE * len(breaking))


def error_words(row: pd.Series, up_to: str = "") -> str:
    """A row's relative error and cosine for a finding; where a side had statistics only,
    the relative error they prove and no cosine."""
    red, cos = row[RED_COLUMN], row["cosine_similarity"]
    nonfinite = _nonfinite_words(row)
    if nonfinite:
        return nonfinite
    if pd.isna(red):
        return "relative error not measured"
    if pd.isna(cos):
        return f"relative error at least {red:.3g} (from the statistics)"
    return f"relative error {up_to}{red:.3g}, cosine {cos:.6f}"


def _nonfinite_words(row: pd.Series) -> str:
    """The row's NaN/Inf reason ("NaN/Inf: golden 0, my 54, 54 positions differ") where the
    sides hold NaN/Inf at different positions (the finite values' metrics say nothing of
    them), else ""."""
    reason = row.get("cmp_fail_reason")
    if not isinstance(reason, str) or not reason.startswith("NaN/Inf:"):
        return ""
    said = reason.split(";")[0]
    return said if "differ" in said else ""


def _reason_counts(reasons: pd.Series) -> dict[str, int]:
    """Rows per kind of reason (the reason before its colon, without its numbers), most
    first; a kind whose rows all say the same numbers is named with them ('batch 1 here, 3 in
    the golden run', not 'batch N here, N ...')."""
    heads = reasons.fillna("").str.split(":").str[0]
    kinds = heads.str.replace(r"\d+", "N", regex=True)
    counts = {}
    for kind, n in kinds.value_counts().items():
        said = heads[kinds == kind].unique()
        counts[str(said[0] if len(said) == 1 else kind)] = int(n)
    return counts


def _sites_only(sites: pd.DataFrame) -> str:
    """The finding when no block output is in both dumps but sub-layers or operators are (a
    dump of some modules of one layer): their verdicts, and the first that breaks tolerance."""
    compared = sites[sites["verdict"] != NOT_COMPARED]
    if compared.empty:
        return ""
    counts = compared["verdict"].value_counts()
    text = (f"no block output is in both dumps; {len(compared)} sub-layer and operator rows "
            "compared: " + ", ".join(f"{int(counts.get(v, 0))} {v}" for v in (PASS, WARN, FAIL)))
    broken = compared[compared["verdict"].isin((WARN, FAIL))]
    if len(broken):
        row = broken.iloc[0]
        text += f"; the first beyond tolerance is {row['module']} ({row['verdict']})"
    return text


def _explain(s: BaselineSummary, compared: pd.DataFrame, same_setup: np.ndarray,
             reds: np.ndarray, sources: np.ndarray, exact: np.ndarray) -> tuple[str, str]:
    """The summary's pattern and finding. ``same_setup``, ``reds`` (``input_reds``),
    ``sources`` (``input_rows``) and ``exact`` (``exact_inputs``) are indexed like the whole
    table, whose index labels ``compared`` keeps."""
    if compared.empty:
        return "nothing", "nothing was compared (see cmp_fail_reason)"
    tol = ", ".join(sorted(set(compared["tolerance"])))
    if s.first_layer is not None:
        where = (
            f"the stack input (the input of {s.first_module or 'the first block'})"
            if s.first_layer < 0
            else f"layer {s.first_layer} ({s.first_module})"
        )
        at = s.first_divergence[s.first_divergence["layer"] == s.first_layer]
        row = at.loc[at[RED_COLUMN].fillna(-1.0).idxmax()]
        if row["verdict"] == FAIL:
            before = s.per_layer.loc[s.per_layer["layer"] < s.first_layer, "layer"]
            fed = (f" (layer {int(before.max())}'s output)"
                   if s.first_layer > 0 and len(before) and before.max() == s.first_layer - 1
                   else "")
            return "introduced", (
                f"{where} introduced the error: its input{fed} agrees with the golden run and its "
                f"output does not, in {s.first_rounds} of {s.rounds} compared rounds "
                f"({error_words(row)}"
                + ("" if _nonfinite_words(row) else f", x{row['error_amplification']:.3g} its "
                   "input's") + f") at {tol} tolerance"
            )
        later = s.per_layer[(s.per_layer["layer"] > s.first_layer)
                            & s.per_layer["verdict"].isin([WARN, FAIL])]
        worst = FAIL if (later["verdict"] == FAIL).any() else WARN
        layers = later.loc[later["verdict"] == worst, "layer"].astype(int).tolist()
        growth = row["error_amplification"]
        origin = ("from an exact input" if s.first_exact_input
                  else "from an input within tolerance")
        return "born", (
            f"error born at {where}: x{growth:.3g} {origin} (relative error "
            f"{_at_least(s)}{row[RED_COLUMN]:.3g}, {row['verdict']}); it reaches {worst} at layers "
            f"{_ranges(layers)} ({s.first_rounds} of {s.rounds} compared rounds, {tol} "
            "tolerance): look at this layer first"
        )
    bad = s.per_layer[s.per_layer["verdict"] != PASS]
    if bad.empty:
        return "clean", (
            f"every compared layer PASSes at {tol} tolerance "
            f"(largest relative error {_at_least(s)}"
            f"{s.per_layer['max_relative_euclidean_distance'].max():.3g})"
            + (_first_difference(compared, same_setup, exact) or _first_proven(compared))
        )
    start = bad.iloc[0]
    broken = compared[(compared["layer"] == start["layer"])
                      & compared["verdict"].isin([WARN, FAIL])]
    if np.isnan(reds[broken.index.to_numpy()]).all():
        held = (sources[broken.index.to_numpy()] >= 0).any()  # in both dumps, not compared
        return "unlocated", _unlocated(s, start, tol, held)
    amplification = s.per_layer["max_error_amplification"]
    growth = amplification.max()
    most = s.per_layer.loc[amplification.idxmax()] if amplification.notna().any() else None
    at = f" (layer {int(most['layer'])}, {most['module']})" if most is not None else ""
    if most is not None and growth >= BIRTH_GROWTH and _bound_grew(compared, most):
        return "gradual", _bounds_jump(s, compared, start, most, tol)
    isolated = " in more than isolated rounds" if growth >= BIRTH_GROWTH else ""
    return "gradual", (
        f"no layer multiplies the error by {BIRTH_GROWTH:g}x or more{isolated}: "
        f"the first layer beyond {tol} tolerance is {int(start['layer'])} ({start['module']}, "
        f"{start['verdict']}); the relative error grows to {_at_least(s)}"
        f"{s.per_layer['max_relative_euclidean_distance'].max():.3g}, at most x{growth:.3g} "
        f"across one layer{at}: an accumulation such as a precision difference, not one "
        f"layer this comparison can single out (a fault that grows the error less than "
        f"{BIRTH_GROWTH:g}x looks the same here; the reference-free report judges each "
        f"layer on its own, by its replays where the dumps hold them)"
        + _first_difference(compared, same_setup, exact)
    )


def _bound_grew(compared: pd.DataFrame, most: pd.Series) -> bool:
    """The largest growth of the layer ``most`` is a statistics-only row's (a bound's)."""
    if BOUND_COLUMN not in compared:
        return False
    at = compared[compared["layer"] == most["layer"]]
    growth = pd.to_numeric(at["error_amplification"], errors="coerce")
    if growth.isna().all():
        return False
    return bool(pd.notna(at.loc[growth.idxmax(), BOUND_COLUMN]))


def _bounds_jump(s: BaselineSummary, compared: pd.DataFrame, start: pd.Series,
                 most: pd.Series, tol: str) -> str:
    """The gradual finding where statistics-only rows hold the largest growth: their relative
    errors are lower bounds, and a jump of bounds proves no birth (the layer before may differ
    as much with equal statistics), so the layer is pointed at, not named as the birth."""
    layer = int(most["layer"])
    at = compared[compared["layer"] == layer]
    jumps = int((pd.to_numeric(at["error_amplification"], errors="coerce")
                 >= BIRTH_GROWTH).sum())
    rounds = len(at[GROUP].drop_duplicates())
    return (
        f"the first layer beyond {tol} tolerance is {int(start['layer'])} ({start['module']}, "
        f"{start['verdict']}); the relative error grows to at least "
        f"{s.per_layer['max_relative_euclidean_distance'].max():.3g}. Where a side holds "
        f"statistics only, the errors are lower bounds, which prove no growth across a layer: "
        f"the largest jump of the bound is x{most['max_error_amplification']:.3g} across layer "
        f"{layer} ({most['module']}), {BIRTH_GROWTH:g}x or more in {jumps} of {rounds} compared "
        f"rounds: look at this layer first (a dump of its tensors, or md5, on both sides "
        f"proves or clears it)" + _first_proven(compared)
    )


def _unlocated(s: BaselineSummary, start: pd.Series, tol: str, held: bool) -> str:
    """The first layer beyond tolerance, whose input is not compared (the layer before it is
    not in both dumps, or, ``held``, not compared there): where the error was born is only
    bounded."""
    layer = int(start["layer"])
    passing = s.per_layer[(s.per_layer["layer"] < layer) & (s.per_layer["verdict"] == PASS)]
    after = (f" and after layer {int(passing['layer'].max())}, the last before it that both "
             "dumps hold and that passes" if len(passing) else "")
    blocks = s.per_layer[s.per_layer["layer"] >= 0]
    fed = blocks["module"].iloc[0] if len(blocks) else "the first block"
    what = (f"the stack input (the input of {fed}" if layer < 0
            else f"layer {layer} ({start['module']}")
    return (f"the error is already beyond {tol} tolerance at {what}, "
            f"{start['verdict']}, relative error {_at_least(s)}"
            f"{start['max_relative_euclidean_distance']:.3g}), whose input "
            + ("was not compared (see the cmp_fail_reason of the layer before it)"
               if held else "is not in both dumps")
            + f": it was born there or before it{after}"
            + ("" if held else "; dump the layers before it on both sides (srdd-dump "
               "--layers; msprobe: a list or scope that holds them) to name the layer"))


# rows one side holds no module or step for (a --layers subset, a site the other did not dump,
# a decode step outside the other's --steps): the unmatched lines and the counts say so; a
# sample one side lacks, a shape or a read that failed are data a PASS must not pass over
ABSENT = (r"^no counterpart: (?:(?:the )?(?:golden|my) (?:layer|site|stack input)|step \d+ "
          r"of (?:golden|my) sample)|^step not kept in ")


def _uncompared(table: pd.DataFrame) -> str:
    """'; but N rows were not compared (shape mismatch: 14, ...)': a PASS
    of the compared rows says nothing of rounds or shapes that could not be paired."""
    missing = (table["verdict"] == NOT_COMPARED).to_numpy()
    # a stack input one side did not record (msprobe's outputs-only dumps): said per row;
    # one that both hold and could not compare (inputs differ) counts as any row
    unrecorded = (table["layer"] == STACK_INPUT).to_numpy(dtype=bool, na_value=False) & (
        table["cmp_fail_reason"].fillna("").str.startswith("missing record").to_numpy())
    reasons = table.loc[missing & ~unrecorded, "cmp_fail_reason"].fillna("")
    reasons = reasons[~reasons.str.contains(ABSENT, regex=True)]
    if reasons.empty:
        return ""
    # named apart from the counterparts the header counts with them (steps, sites, layers)
    reasons = reasons.str.replace(r"^no counterpart: (?:golden|my) sample \d+ is not in .*",
                                  "a sample only one dump holds", regex=True)
    # a row without a layer is a whole round (a sample's step one dump lacks): every layer
    rounds = table.loc[reasons.index, "layer"].isna().to_numpy()
    whole = int(rounds.sum())
    parts = [f"{n} {word}{'s' if n != 1 else ''}{extra}" for n, word, extra in (
        (whole, "round", " (every layer of it)" if whole == 1 else " (every layer of them)"),
        (len(reasons) - whole, "row", "")) if n]
    # each kind's count in its unit: whole rounds and rows are not added together
    counts: dict[str, list[str]] = {}
    for unit, picked in (("round", rounds), ("row", ~rounds)):
        for kind, n in _reason_counts(reasons[picked]).items():
            counts.setdefault(kind, []).append(f"{n} {unit}{'s' if n != 1 else ''}")
    return (f"; but {' and '.join(parts)} {'was' if len(reasons) == 1 else 'were'} not "
            "compared ("
            + ", ".join(f"{kind}: {' and '.join(n)}" for kind, n in counts.items())
            + "; see cmp_fail_reason): the PASS covers the compared rows only")


def _at_least(s: BaselineSummary) -> str:
    """'at least ' where a side had statistics only: the relative errors are their bounds."""
    return "at least " if s.bounded else ""


def _first_difference(compared: pd.DataFrame, same_setup: np.ndarray, exact: np.ndarray
                      ) -> str:
    """'; the outputs first differ at layer K (xN from an exact input)' when both sides have
    the same dtype and device type and some layer turns an exactly equal input into a
    different output. ``same_setup`` is indexed like the whole table."""
    differ = _proven_different(compared)
    for pos in range(len(compared)):
        row = compared.iloc[pos]
        if (differ[pos] and same_setup[compared.index[pos]]
                and pd.notna(row["layer"]) and exact[compared.index[pos]]):
            how = (f"x{row['error_amplification']:.3g}" if row[RED_COLUMN] > 0
                   else "its md5 differs")
            return (f"; the outputs first differ at layer {int(row['layer'])} "
                    f"({row['module']}, {how} from an exact input)")
    return ""


def _proven_different(rows: pd.DataFrame) -> np.ndarray:
    """Per row: the two outputs are known to differ (a relative error, or the bound its
    statistics prove, above 0; or their md5 values differ)."""
    md5 = rows["cmp_fail_reason"].astype(str).str.contains(MD5_DIFFER, regex=False)
    return ((rows[RED_COLUMN] > 0) | md5).to_numpy(dtype=bool, na_value=False)


def _first_proven(compared: pd.DataFrame) -> str:
    """'; the statistics first differ at layer K (...)' where rows had statistics only: the
    first layer whose Max, Min, Mean or Norm differ (its bound above 0) in some round. Equal
    statistics prove no equal tensors, so no input is called exact."""
    if BOUND_COLUMN not in compared:
        return ""
    proven = compared[compared[BOUND_COLUMN].notna() & _proven_different(compared)
                      & compared["layer"].notna()]
    if proven.empty:
        return ""
    layer = proven["layer"].min()
    at = proven[proven["layer"] == layer]
    rounds = len(compared.loc[compared["layer"] == layer, GROUP].drop_duplicates())
    return (f"; the statistics first differ at layer {int(layer)} "
            f"({at['module'].iloc[0]}, in {len(at)} of {rounds} compared rounds)")


def _ranges(layers: list[int]) -> str:
    """[27, 28, 29, 31] -> '27-29, 31'."""
    if not layers:
        return "none"
    parts, start, prev = [], layers[0], layers[0]
    for k in layers[1:] + [None]:
        if k is not None and k == prev + 1:
            prev = k
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if k is not None:
            start = prev = k
    return ", ".join(parts)
