"""Pairing of two dumps: samples by their recorded input, rounds by step, layers by name.

Pure functions over the reader's ``rounds`` array and layer names; nothing is read here.

* Samples pair by the token-ids hash of their first captured round (the prefill); where a side
  recorded no ids, by the prefill's length; then the ones left over pair in order.
* Rounds of a sample pair by step. A round's inputs are ``same`` when its hash and the hash of
  every earlier captured round of the sample agree (the KV cache holds them all), and where
  both dumps recorded the hash of every input id of the sample up to the round (the steps not
  captured too), those agree; ``differ`` when one of them differs and ``unknown`` when one side
  did not record its input ids.
* Layers pair by module name, then the ones left over by index.

Anything left without a partner is returned with ``None`` on the missing side, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAME = "same"
DIFFER = "differ"
UNKNOWN = "unknown"
_WORSE = {SAME: 0, UNKNOWN: 1, DIFFER: 2}


@dataclass(frozen=True)
class RoundPair:
    """One (sample, step) of my dump and its counterpart in the golden dump."""

    sample: int | None  # my sample number (None: the golden round has no counterpart)
    golden_sample: int | None
    step: int
    round: int | None  # my round number
    golden_round: int | None
    input_match: str  # SAME / DIFFER / UNKNOWN for rounds present on both sides; "" otherwise
    reason: str = ""  # why a round has no counterpart, or why its inputs differ


def input_match(hash_a: int, hash_b: int) -> str:
    if not hash_a or not hash_b:
        return UNKNOWN
    return SAME if hash_a == hash_b else DIFFER


def _samples(rounds: np.ndarray) -> dict[int, list[np.void]]:
    """sample -> its rounds sorted by step, samples in order of first appearance."""
    out: dict[int, list[np.void]] = {}
    for row in rounds:
        out.setdefault(int(row["sample"]), []).append(row)
    return {k: sorted(v, key=lambda r: int(r["step"])) for k, v in out.items()}


def pair_samples(
    mine: np.ndarray, golden: np.ndarray
) -> list[tuple[int | None, int | None]]:
    """(my sample, golden sample) pairs: by input hash first, then in order; None = unpaired.
    A prompt my run repeated more often than the golden one pairs with its golden sample
    again (the same inputs, the same expected outputs)."""
    my_s, golden_s = _samples(mine), _samples(golden)
    key_g = {s: int(rows[0]["tokens_hash"]) for s, rows in golden_s.items()}
    used: set[int] = set()
    partner: dict[int, int] = {}
    for s, rows in my_s.items():
        h = int(rows[0]["tokens_hash"])
        if not h:
            continue
        same = [g for g, hg in key_g.items() if hg == h]
        fresh = [g for g in same if g not in used]
        if fresh or same:
            partner[s] = (fresh or same)[0]
            used.add(partner[s])
    left_g = [g for g in golden_s if g not in used]
    # without input ids on a side, a prefill's length tells prompts apart: a golden run
    # dumped for some steps only (msprobe's "step" filter) holds the later prompts alone
    for s, rows in my_s.items():
        if s in partner or rows[0]["step"] != 0:
            continue
        same_length = [g for g in left_g if golden_s[g][0]["step"] == 0
                       and not (int(rows[0]["tokens_hash"]) and key_g[g])
                       and golden_s[g][0]["seq"] == rows[0]["seq"]]
        if same_length:
            partner[s] = same_length[0]
            left_g.remove(same_length[0])
    for s in my_s:
        if s not in partner and left_g:
            partner[s] = left_g.pop(0)
    pairs: list[tuple[int | None, int | None]] = [(s, partner.get(s)) for s in my_s]
    pairs += [(None, g) for g in left_g]
    return pairs


def pair_rounds(mine: np.ndarray, golden: np.ndarray,
                histories: tuple[dict[int, int], dict[int, int]] = ({}, {})
                ) -> list[RoundPair]:
    """Every round of both dumps, paired by (sample pair, step); see the module docstring.
    ``histories``: per side, round -> the hash of every input id of its sample up to it, the
    steps not captured included: where both sides have it, a decode round's inputs are the
    same only when those agree."""
    my_s, golden_s = _samples(mine), _samples(golden)
    out: list[RoundPair] = []
    for s, g in pair_samples(mine, golden):
        if g is None:
            for row in my_s[s]:
                out.append(RoundPair(s, None, int(row["step"]), int(row["round"]), None, "",
                                     f"no counterpart: my sample {s} is not in the golden dump"))
            continue
        if s is None:
            for row in golden_s[g]:
                out.append(RoundPair(None, g, int(row["step"]), None, int(row["round"]), "",
                                     f"no counterpart: golden sample {g} is not in my dump"))
            continue
        mine_by_step = {int(r["step"]): r for r in my_s[s]}
        golden_by_step = {int(r["step"]): r for r in golden_s[g]}
        state, reason = SAME, ""
        for step in sorted(set(mine_by_step) | set(golden_by_step)):
            a, b = mine_by_step.get(step), golden_by_step.get(step)
            if a is None or b is None:
                where = f"my sample {s}" if a is not None else f"golden sample {g}"
                other = "the golden dump" if a is not None else "my dump"
                # a later step of the sample on that side: its --steps left this one out
                skipped = max(golden_by_step if b is None else mine_by_step) > step
                out.append(RoundPair(
                    s, g, step, None if a is None else int(a["round"]),
                    None if b is None else int(b["round"]), "",
                    f"step not kept in {other}: step {step} of {where} is not in {other}, "
                    "a later step of it is (its capture's --steps, or a --tokens selection "
                    "that kept no position there)" if skipped else
                    f"no counterpart: step {step} of {where} is not in {other}",
                ))
                continue
            here = input_match(int(a["tokens_hash"]), int(b["tokens_hash"]))
            why = ""
            before = (histories[0].get(int(a["round"])), histories[1].get(int(b["round"])))
            if here == SAME and step > 0 and all(before) and before[0] != before[1]:
                here = DIFFER
                why = ("a token generated before this step differs from the golden run's, at "
                       "a step not captured (the KV cache holds it)")
            if here == UNKNOWN and step == 0 and int(a["seq"]) != int(b["seq"]):
                here = DIFFER  # ids not recorded, but prompts of other lengths: other prompts
                why = (f"prompts of other lengths ({int(a['seq'])} tokens here, "
                       f"{int(b['seq'])} in the golden run; no input ids recorded)")
            state = max(state, here, key=_WORSE.__getitem__)
            batches = (int(a["batch"]), int(b["batch"]))
            why = _batched(*batches) if batches[0] != batches[1] else why
            out.append(RoundPair(s, g, step, int(a["round"]), int(b["round"]), state,
                                 why or reason))
            reason = why or reason  # a sample's later rounds differ for the same reason
    return out


def _batched(mine: int, golden: int) -> str:
    """Why the inputs of a round differ when the two runs batched their prompts differently
    (a batch's sequences pair by their position in it)."""
    return f"batched differently (batch {mine} here, {golden} in the golden run)"


def pair_layers(mine: list[str], golden: list[str]) -> list[tuple[int | None, int | None]]:
    """(my layer, golden layer) pairs by module name, then by index; in layer order."""
    golden_index = {}
    for j, name in enumerate(golden):
        golden_index.setdefault(name, j)
    partner: dict[int, int] = {}
    used: set[int] = set()
    for i, name in enumerate(mine):
        j = golden_index.get(name)
        if j is not None and j not in used:
            partner[i] = j
            used.add(j)
    for i in range(len(mine)):
        if i not in partner and i < len(golden) and i not in used:
            partner[i] = i
            used.add(i)
    pairs: list[tuple[int | None, int | None]] = [(i, partner.get(i)) for i in range(len(mine))]
    for j in range(len(golden)):
        if j not in used:
            # Insert golden-only layers after the last pair whose golden index is below j.
            at = len(pairs)
            for k, (_, gj) in enumerate(pairs):
                if gj is not None and gj > j:
                    at = k
                    break
            pairs.insert(at, (None, j))
    return pairs
